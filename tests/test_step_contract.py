"""The step contract: the scheduler's message is plain data and all a runner needs.

A stand-in runner keeps only what ``RunnerRequests`` builds from the (encoded and decoded)
messages; after every step its tokens and block tables must equal the scheduler's, under
chunked prefill, prefix hits, forks (copy-on-write), a sliding window (tables rewritten at the
front), preemption and beam search's token swap. No model runs.
"""

from __future__ import annotations

import ast
import inspect
import pickle
from pathlib import Path

import pytest
import torch

import pagefold
from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_cache_planner import plan_pagefold
from pagefold.core.kv_cache_spec import (
    FullAttentionSpec,
    SlidingWindowSpec,
    StateComponent,
    StateSpec,
)
from pagefold.core.sched_output import SampledToken, decode_step, encode_step
from pagefold.core.scheduler import Scheduler, table_diff
from pagefold.engine.core import EngineCore
from pagefold.executor.runner_state import RunnerRequests
from pagefold.request import Request, RequestStatus
from pagefold.sampling_params import SamplingParams

BS = 4
ATTN = FullAttentionSpec(num_kv_heads=2, head_dim=8, dtype=torch.float32)
SWA = SlidingWindowSpec(num_kv_heads=2, head_dim=8, dtype=torch.float32, window=6)
STATE = StateSpec("gdn", (StateComponent("conv", (4, 2), torch.float32),
                          StateComponent("ssm", (2, 16, 16), torch.float32)))
ROOT = Path(pagefold.__file__).parent


def _scheduler(num_blocks: int, capture_in_kernel: bool = False) -> Scheduler:
    specs = {"l0": ATTN, "l1": SWA, "l2": STATE}
    page = ATTN.page_bytes(BS)
    probe = plan_pagefold(specs, BS, page)
    cfg = plan_pagefold(specs, BS, num_blocks * probe.layers_per_group * page)
    kv = KVCacheManager(cfg, enable_prefix_caching=True, checkpoint_interval=8,
                        capture_in_kernel=capture_in_kernel)
    return Scheduler(kv, max_num_batched_tokens=11, max_num_seqs=8, max_model_len=200)


def _fake_sample(tokens: list[int]) -> int:
    return 10 + sum(tokens) % 37


@pytest.mark.parametrize("capture", [False, True], ids=["cut", "captured"])
def test_runner_state_follows_the_scheduler_through_every_kind_of_step(capture):
    """With ``capture``: state checkpoints inside chunks travel in the message and reach the
    runner's batch as (row, prefix length, pages) of the right request."""
    s = _scheduler(80, capture_in_kernel=capture)
    system = list(range(20, 41))
    for i in range(6):
        prompt = system + [50 + i] * (3 + 2 * i)
        kw = {"fork_children": 2, "fork_at": len(prompt) - 1} if i == 2 else {}
        s.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=12 + i),
                              arrival_time=float(i), **kw))
    runner = RunnerRequests()
    seen = {"new": 0, "cached": 0, "rewrite": 0, "copies": 0, "preempted": 0}
    if capture:
        seen["captures"] = 0
    for step in range(400):
        if not s.has_unfinished():
            break
        out = s.schedule()
        wire = decode_step(encode_step(out))
        assert wire == out and pickle.loads(pickle.dumps(out)) == out
        seen["new"] += len(out.new_reqs)
        seen["cached"] += len(out.cached_reqs)
        seen["rewrite"] += sum(1 for c in out.cached_reqs for d in c.new_block_ids
                               if d is not None and d[0] < 2)
        seen["copies"] += len(out.copies)
        seen["preempted"] += len(out.preempted_ids)
        batch = runner.apply(wire)
        assert capture or not out.captures
        if out.captures:
            seen["captures"] += len(out.captures)
            got = [(batch.reqs[i].req_id, p, pg) for caps in batch.captures.values()
                   for i, p, pg in caps]
            assert sorted(got) == sorted((c.request_id, c.num_tokens, c.pages)
                                         for c in out.captures)
            for c in out.captures:  # strictly inside the request's chunk, block-aligned
                start = s.requests[c.request_id].num_computed_tokens
                assert start < c.num_tokens < start + out.num_scheduled[c.request_id]
                assert c.num_tokens % BS == 0
        sampled = {}
        for st, start, n in zip(batch.reqs, batch.starts, batch.counts):
            r = s.requests[st.req_id]
            assert start == r.num_computed_tokens
            assert st.token_ids[: start + n] == r.all_token_ids[: start + n]
            assert st.output_token_ids == r.output_token_ids[: len(st.output_token_ids)]
            assert st.block_ids == s.kv.block_ids(st.req_id)
            assert (start + n >= len(st.token_ids)) == (start + n == r.num_tokens)
            if start + n >= len(st.token_ids):
                sampled[st.req_id] = SampledToken(_fake_sample(st.token_ids))
        s.update_from_output(out, sampled)
        if step == 30 and "r1" in s.requests:  # beam search's token swap on a running request
            r1 = s.requests["r1"]
            if r1.num_computed_tokens < r1.num_tokens:
                s.replace_last_token("r1", 99)
    assert not s.has_unfinished()
    assert all(v > 0 for v in seen.values()), seen
    s.kv.check_whole()


def test_table_diff():
    assert table_diff([1, 2], [1, 2]) is None
    assert table_diff([1, 2], [1, 2, 3, 4]) == (2, [3, 4])
    assert table_diff([1, 2, 3], [1, 9, 3]) == (1, [9, 3])
    assert table_diff([1, 2, 3], [0, 0, 3, 5]) == (0, [0, 0, 3, 5])
    assert table_diff([], [4]) == (0, [4])


def test_finished_request_is_freed_on_its_step_and_reported_once():
    s = _scheduler(40)
    s.add_request(Request("a", [5, 6, 7], SamplingParams(max_tokens=1)))
    out = s.schedule()
    outs = s.update_from_output(out, {"a": SampledToken(3)})
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == [("a", [3],
                                                                                 "length")]
    assert "a" not in s.requests and s.requests == {}
    nxt = s.schedule()
    assert nxt.finished_ids == ["a"] and not nxt.has_tokens
    s.update_from_output(nxt, {})
    assert s.schedule().finished_ids == []
    s.kv.check_whole()


def test_stop_rules_live_in_update_from_output():
    s = _scheduler(40)
    sp = SamplingParams(max_tokens=10, stop_token_ids=[8], min_tokens=2)
    s.add_request(Request("a", [5, 6, 7], sp, eos_token_id=2))
    got = []
    for tok in (2, 8):  # eos is not a stop before min_tokens; the stop id is after it
        out = s.schedule()
        (o,) = s.update_from_output(out, {"a": SampledToken(tok)})
        got.append((o.finish_reason, o.stop_reason))
    assert got == [(None, None), ("stop", 8)]
    assert s.schedule().finished_ids == ["a"]


def _imports(path: Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module)
        elif isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
    return mods


def test_runner_never_imports_the_request_module():
    """Everything the runner imports (transitively, within pagefold) stays clear of the
    scheduler's request objects: it works from the step message alone."""
    todo, seen = ["pagefold.executor.model_runner"], set()
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        path = ROOT.parent / (mod.replace(".", "/") + ".py")
        if not path.exists():
            path = path.with_suffix("") / "__init__.py"
        if path.exists() and mod != "pagefold":
            todo.extend(m for m in _imports(path) if m.startswith("pagefold."))
    assert "pagefold.executor.runner_state" in seen and "pagefold.core.sched_output" in seen
    banned = {"pagefold.request", "pagefold.core.scheduler", "pagefold.core.kv_cache_manager"}
    assert not seen & banned, seen & banned


def test_engine_step_is_schedule_execute_update():
    tree = ast.parse(inspect.getsource(EngineCore.step).strip())
    calls = [ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)]
    # (Pipeline parallelism: the batch queue makes the same calls, several messages at once.)
    assert sorted(calls) == ["self.batches.step", "self.runner.execute",
                             "self.scheduler.schedule", "self.scheduler.update_from_output"]


def test_finish_while_waiting_drops_nothing_the_runner_holds():
    s = _scheduler(40)
    s.add_request(Request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=3)))
    runner = RunnerRequests()
    out = s.schedule()
    runner.apply(out)
    s.update_from_output(out, {"a": SampledToken(4)})
    assert "a" in runner.states
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    runner.apply(s.schedule())
    assert "a" not in runner.states


def test_hit_blocks_are_held_while_other_groups_allocate():
    """A hybrid request admitted with a prefix hit: its state pages are allocated from the
    free queue, which must not evict the cached attention blocks the same hit reads (the
    scheduler used to trip ``take_hit``'s assertion here, on Qwen3.5's per-rank pool)."""
    from pagefold.core.capacity import capacity_report
    from pagefold.core.spec_from_config import layer_specs_from_config
    from pagefold.testing.tiny_models import arch_config_kwargs, random_prompts

    cfg = dict(arch_config_kwargs("qwen3_5"), model_type="qwen3_5_text")
    specs = layer_specs_from_config(cfg, model_dtype=torch.float32, tensor_parallel_size=2)
    rep = capacity_report(specs, layout="pagefold", memory_bytes=1 << 24, max_model_len=128,
                          block_size=16, enable_prefix_caching=True)
    probe = plan_pagefold(specs, 16, 1 << 24)
    cfg_pool = plan_pagefold(specs, 16, (rep["blocks_per_request"] + 3)
                             * probe.layers_per_group * probe.page_bytes)
    kv = KVCacheManager(cfg_pool, enable_prefix_caching=True)
    s = Scheduler(kv, max_num_batched_tokens=13, max_num_seqs=256, max_model_len=128)
    prefix = random_prompts(1, 40, 40, 500, seed=7)[0]
    prompts = [prefix + t for t in random_prompts(5, 3, 30, 500, seed=3)]
    n = 0
    for _ in range(2):
        for p in prompts:
            s.add_request(Request(str(n), list(p), SamplingParams(max_tokens=8, ignore_eos=True)))
            n += 1
        while s.has_unfinished():
            out = s.schedule()
            sampled = {rid: SampledToken(7) for rid, k in out.num_scheduled.items()
                       if s.requests[rid].num_computed_tokens + k >= s.requests[rid].num_tokens}
            s.update_from_output(out, sampled)
    assert s.num_preemptions > 0 and kv.stats.hits > 0
    kv.check_whole()
