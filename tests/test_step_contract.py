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


def _scheduler(num_blocks: int) -> Scheduler:
    specs = {"l0": ATTN, "l1": SWA, "l2": STATE}
    page = ATTN.page_bytes(BS)
    probe = plan_pagefold(specs, BS, page)
    cfg = plan_pagefold(specs, BS, num_blocks * probe.layers_per_group * page)
    kv = KVCacheManager(cfg, enable_prefix_caching=True, checkpoint_interval=8)
    return Scheduler(kv, max_num_batched_tokens=11, max_num_seqs=8, max_model_len=200)


def _fake_sample(tokens: list[int]) -> int:
    return 10 + sum(tokens) % 37


def test_runner_state_follows_the_scheduler_through_every_kind_of_step():
    s = _scheduler(80)
    system = list(range(20, 41))
    for i in range(6):
        prompt = system + [50 + i] * (3 + 2 * i)
        kw = {"fork_children": 2, "fork_at": len(prompt) - 1} if i == 2 else {}
        s.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=12 + i),
                              arrival_time=float(i), **kw))
    runner = RunnerRequests()
    seen = {"new": 0, "cached": 0, "rewrite": 0, "copies": 0, "preempted": 0}
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
    assert calls == ["self.scheduler.schedule", "self.runner.execute",
                     "self.scheduler.update_from_output"]


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
