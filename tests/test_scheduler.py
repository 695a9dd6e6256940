"""Scheduler rules on a hand-built pool, with a stand-in for the model (no forward pass).

``_advance`` plays the runner's part only: every request whose scheduled tokens reach the end
of its tokens samples token 7; ``Scheduler.update_from_output`` does the rest (computed
tokens, appends, stop rules, frees finished requests on that step).
"""

from __future__ import annotations

import pytest
import torch

from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_cache_planner import plan_pagefold
from pagefold.core.kv_cache_spec import FullAttentionSpec
from pagefold.core.sched_output import SampledToken
from pagefold.core.scheduler import Scheduler, SchedulerOutput
from pagefold.request import Request, RequestStatus
from pagefold.sampling_params import SamplingParams

BS = 4
ATTN = FullAttentionSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32)


def _scheduler(num_blocks: int, budget: int, *, max_num_seqs: int = 64,
               max_model_len: int = 1000, policy: str = "fcfs") -> Scheduler:
    cfg = plan_pagefold({"layers.0": ATTN}, BS, num_blocks * ATTN.page_bytes(BS))
    assert cfg.num_blocks == num_blocks
    return Scheduler(KVCacheManager(cfg), max_num_batched_tokens=budget,
                     max_num_seqs=max_num_seqs, max_model_len=max_model_len, policy=policy)


def _req(rid: str, n_prompt: int, max_tokens: int = 4, *, priority: int = 0,
         arrival: float = 0.0) -> Request:
    return Request(rid, list(range(10, 10 + n_prompt)), SamplingParams(max_tokens=max_tokens),
                   priority=priority, arrival_time=arrival)


def _advance(s: Scheduler, out: SchedulerOutput) -> list[str]:
    """Sample token 7 for every row that reaches its request's end; returns the ids finished
    this step."""
    sampled = {}
    for rid, n in out.num_scheduled.items():
        r = s.requests[rid]
        if r.num_computed_tokens + n == r.num_tokens:
            sampled[rid] = SampledToken(7)
    outs = s.update_from_output(out, sampled)
    assert [o.request_id for o in outs] == list(sampled)
    return [o.request_id for o in outs if o.finish_reason is not None]


def _drain(s: Scheduler, max_steps: int = 500) -> list[SchedulerOutput]:
    outs = []
    while s.has_unfinished():
        out = s.schedule()
        outs.append(out)
        _advance(s, out)
        assert len(outs) < max_steps, "scheduler stopped making progress"
    return outs


def test_token_budget_respected_and_everything_finishes():
    s = _scheduler(64, budget=7)
    reqs = [_req(f"r{i}", n) for i, n in enumerate([5, 13, 1, 22, 9, 3])]
    for r in reqs:
        s.add_request(r)
    outs = _drain(s)
    assert all(0 < o.total_tokens <= 7 for o in outs)
    assert all(r.num_output_tokens == 4 for r in reqs)
    # Each request computed exactly its prompt and all outputs but the last, once (no preemption).
    total = sum(o.total_tokens for o in outs)
    assert total == sum(r.num_prompt_tokens + 3 for r in reqs)
    s.kv.check_whole()


def test_running_before_waiting_and_prefill_chunks_mix_with_decodes():
    s = _scheduler(64, budget=8)
    a = _req("a", 3, max_tokens=10)
    s.add_request(a)
    _advance(s, s.schedule())  # a's prompt
    s.add_request(_req("b", 20))
    plan = []
    for _ in range(3):
        out = s.schedule()
        plan.append(list(out.num_scheduled.items()))
        _advance(s, out)
    # a decodes first in every step; b's prompt fills the rest of the budget in chunks.
    assert plan == [[("a", 1), ("b", 7)], [("a", 1), ("b", 7)], [("a", 1), ("b", 6)]]
    assert s.requests["b"].num_output_tokens == 1


def test_max_num_seqs_caps_running():
    s = _scheduler(64, budget=100, max_num_seqs=2)
    for i in range(3):
        s.add_request(_req(f"r{i}", 4, max_tokens=2))
    out = s.schedule()
    assert list(out.num_scheduled) == ["r0", "r1"] and s.num_waiting == 1
    _advance(s, out)
    out = s.schedule()
    assert list(out.num_scheduled) == ["r0", "r1"]  # still full: r2 waits
    assert _advance(s, out) == ["r0", "r1"]
    out = s.schedule()
    assert list(out.num_scheduled) == ["r2"]


def test_fcfs_preempts_latest_arrival_and_requeues_it_first():
    s = _scheduler(5, budget=100)  # 4 usable blocks of 4 tokens
    reqs = [_req(x, 4, max_tokens=3, arrival=i) for i, x in enumerate("abc")]
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    assert list(out.num_scheduled) == ["a", "b", "c"]
    _advance(s, out)
    assert s.kv.pool.num_free == 1
    s.add_request(_req("d", 2, arrival=9))
    out = s.schedule()
    # a takes the last block; b needs one: c (latest arrival) is preempted to make room, and
    # nothing is admitted on a step that preempted.
    assert out.preempted_ids == ["c"]
    assert out.num_scheduled == {"a": 1, "b": 1}
    c = s.requests["c"]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.num_output_tokens == 1 and s.num_preemptions == 1
    assert s.kv.block_ids("c") == [[]]
    assert [r.request_id for r in s.waiting] == ["c", "d"]  # ahead of later arrivals
    _drain(s)
    assert all(r.num_output_tokens == 3 for r in reqs)
    s.kv.check_whole()


def test_preempted_request_recomputes_prompt_and_outputs():
    s = _scheduler(5, budget=100)
    for i, x in enumerate("abc"):
        s.add_request(_req(x, 4, max_tokens=3, arrival=i))
    _advance(s, s.schedule())
    _advance(s, s.schedule())  # c preempted with 1 output token
    assert s.requests["c"].status == RequestStatus.PREEMPTED
    outs = _drain(s)
    resumed = [o.num_scheduled["c"] for o in outs if "c" in o.num_scheduled]
    assert resumed[0] == 5  # 4 prompt tokens + the 1 already sampled output token


def test_priority_policy_admits_by_priority_then_arrival():
    s = _scheduler(64, budget=100, max_num_seqs=1, policy="priority")
    for rid, prio, t in [("low", 5, 0.0), ("high_late", 1, 2.0), ("high_early", 1, 1.0),
                         ("mid", 3, 0.5)]:
        s.add_request(_req(rid, 3, max_tokens=1, priority=prio, arrival=t))
    order = []
    while s.has_unfinished():
        out = s.schedule()
        order += [rid for rid in out.num_scheduled if rid not in order]
        _advance(s, out)
    assert order == ["high_early", "high_late", "mid", "low"]


def test_priority_policy_preempts_lowest_priority_and_keeps_others_running():
    s = _scheduler(5, budget=100, policy="priority")  # 4 usable blocks of 4 tokens
    # "bulk" runs first but has the worst priority value: it is the victim later.
    s.add_request(_req("bulk", 4, max_tokens=6, priority=9, arrival=0.0))
    _advance(s, s.schedule())
    for rid, t in [("x", 1.0), ("y", 2.0)]:
        s.add_request(_req(rid, 4, max_tokens=3, priority=0, arrival=t))
    out = s.schedule()
    assert out.num_scheduled == {"bulk": 1, "x": 4, "y": 4}
    _advance(s, out)
    assert s.kv.pool.num_free == 0
    out = s.schedule()
    # x needs a block: bulk (ahead of x in the running list) is preempted, and y, which needs
    # no new block, still runs this step.
    assert out.preempted_ids == ["bulk"]
    assert out.num_scheduled == {"x": 1, "y": 1}
    _drain(s)
    s.kv.check_whole()


def test_finished_request_frees_blocks_on_that_step():
    s = _scheduler(16, budget=100)
    s.add_request(_req("a", 9, max_tokens=1))
    s.add_request(_req("b", 4, max_tokens=5))
    out = s.schedule()
    held = s.kv.pool.num_free
    assert _advance(s, out) == ["a"]
    assert s.kv.pool.num_free == held + 3  # a's 3 blocks, at once
    assert s.kv.block_ids("a") == [[]]
    nxt = s.schedule()
    assert nxt.finished_ids == ["a"] and "a" not in nxt.num_scheduled


def test_abort_waiting_and_running():
    s = _scheduler(16, budget=100, max_num_seqs=1)
    s.add_request(_req("run", 4))
    s.add_request(_req("wait", 4))
    _advance(s, s.schedule())
    assert s.finish_request("wait", RequestStatus.FINISHED_ABORTED).status.finish_reason == "abort"
    assert s.finish_request("run", RequestStatus.FINISHED_ABORTED) is not None
    assert s.finish_request("run", RequestStatus.FINISHED_ABORTED) is None  # idempotent
    assert not s.has_unfinished() and s.num_waiting == 0
    s.kv.check_whole()


def test_running_request_never_scheduled_past_max_model_len():
    s = _scheduler(64, budget=100, max_model_len=10)
    r = _req("a", 6, max_tokens=100)
    s.add_request(r)
    for _ in range(20):
        out = s.schedule()
        if out.is_empty:
            break
        assert r.num_computed_tokens + out.num_scheduled["a"] <= 10
        _advance(s, out)
    # The stop rule ends it when its tokens reach max_model_len (the last one uncomputed).
    assert r.num_tokens == 10 and r.num_computed_tokens == 9
    assert r.status == RequestStatus.FINISHED_LENGTH
    s.kv.check_whole()


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_schedule_is_deterministic(policy: str):
    def trace() -> list[list[tuple[str, int]]]:
        s = _scheduler(7, budget=6, policy=policy)
        for i, n in enumerate([7, 3, 11, 5, 2]):
            s.add_request(_req(f"r{i}", n, max_tokens=5, priority=i % 2, arrival=float(i)))
        outs = _drain(s)
        assert s.num_preemptions > 0  # the pool is tight enough to exercise preemption
        s.kv.check_whole()
        return [list(o.num_scheduled.items()) for o in outs]

    assert trace() == trace()


@pytest.mark.parametrize("stop", ["eos", "stop_id"])
def test_stop_tokens_wait_for_min_tokens(stop: str):
    """The runner's token is checked against min_tokens too: a stop id (or eos) sampled before
    ``min_tokens`` outputs exist does not finish the request (the sampler bans them, but the
    scheduler's rule must hold for any runner, e.g. accepted drafts)."""
    s = _scheduler(num_blocks=16, budget=64)
    sp = SamplingParams(max_tokens=10, min_tokens=3,
                        stop_token_ids=[7] if stop == "stop_id" else None)
    s.add_request(Request("a", list(range(10, 15)), sp, eos_token_id=7 if stop == "eos" else 2))
    finished_at = None
    for step in range(12):
        out = s.schedule()
        if _advance(s, out):
            finished_at = step
            break
    assert finished_at == 2, finished_at  # outputs 1 and 2 continue; the third stops
    s.kv.check_whole()
