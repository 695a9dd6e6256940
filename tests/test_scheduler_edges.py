"""Scheduler rules at their edges, on a stand-in model (issue 44: mutmut's survivors in
``core/scheduler.py``). Each expectation is the documented rule, worked out by hand."""

from __future__ import annotations

import torch

from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_cache_planner import plan_pagefold
from pagefold.core.kv_cache_spec import FullAttentionSpec, StateComponent, StateSpec
from pagefold.core.sched_output import SampledToken, VerifiedTokens
from pagefold.core.scheduler import Scheduler
from pagefold.request import Request, RequestStatus
from pagefold.sampling_params import SamplingParams

BS = 4
ATTN = FullAttentionSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32)
STATE = StateSpec("gdn", (StateComponent("ssm", (64,), torch.float32),))  # two pages


def _sched(blocks: int, budget: int = 64, caching: bool = False, specs=None) -> Scheduler:
    specs = specs or {"a": ATTN}
    kv = KVCacheManager(plan_pagefold(specs, BS, (blocks + 1) * ATTN.page_bytes(BS)),
                        enable_prefix_caching=caching)
    return Scheduler(kv, max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=64)


def _req(rid, prompt, max_tokens=8, **kw):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                     **kw.pop("sp", {})), **kw)


def _step(s: Scheduler):
    out = s.schedule()
    s.update_from_output(out, {rid: SampledToken(7) for rid, n in out.num_scheduled.items()
                               if s.requests[rid].num_computed_tokens + n
                               == s.requests[rid].num_tokens})
    return out


def test_no_budget_left_admits_nobody():
    """A budget of 4 spent by a running prefill: the waiting request stays waiting."""
    s = _sched(32, budget=4)
    s.add_request(_req("a", range(10), arrival_time=0.0))
    s.add_request(_req("b", range(20, 23), arrival_time=1.0))
    out = s.schedule()
    assert out.num_scheduled == {"a": 4} and s.num_running == 1 and s.num_waiting == 1


def test_a_request_ended_during_the_step_does_not_stop_the_others():
    s = _sched(32)
    for i, rid in enumerate("abc"):
        s.add_request(_req(rid, range(10 * i, 10 * i + 3), arrival_time=float(i)))
    out = s.schedule()
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)  # the API's abort, mid-step
    outs = s.update_from_output(out, {rid: SampledToken(7) for rid in "abc"})
    assert [o.request_id for o in outs] == ["b", "c"]
    assert s.requests["c"].output_token_ids == [7]


def test_two_verified_requests_in_one_step():
    s = _sched(32)
    for i, rid in enumerate("ab"):
        s.add_request(_req(rid, range(10 * i, 10 * i + 3), arrival_time=float(i)))
    _step(s)
    s.spec_token_ids = {"a": [1, 2], "b": [3]}
    out = s.schedule()
    assert out.num_scheduled == {"a": 3, "b": 2}
    outs = s.update_from_output(out, {"a": VerifiedTokens([1, 9], 1),
                                      "b": VerifiedTokens([3, 8], 1)})
    assert [(o.request_id, o.new_token_ids) for o in outs] == [("a", [1, 9]), ("b", [3, 8])]
    assert [s.requests[r].num_computed_tokens for r in "ab"] == [5, 5]


def test_a_family_with_room_for_one_child_forks_one():
    """A state-only model (a state is one page): two children, one page free when the family
    forks. The first child continues from the parent's state, the second starts over as a
    waiting request."""
    s = _sched(9, specs={"state": STATE})
    s.add_request(_req("p", range(13), fork_children=2, fork_at=12))
    _step(s)  # 12 tokens: the parent's state (1 of 9 pages)
    held = s.kv.pool.allocate(s.kv.pool.num_free - 1)
    out = s.schedule()
    kids = sorted((r for r in s.requests.values() if r.parent_id == "p"),
                  key=lambda r: r.index)
    assert [k.status for k in kids] == [RequestStatus.RUNNING, RequestStatus.WAITING]
    assert out.num_scheduled == {"p": 1, kids[0].request_id: 1}
    assert s.kv.pool.num_free == 0
    s.kv.pool.free(held)


def test_a_request_preempted_three_times_is_spared():
    """fcfs takes the latest running request as the victim, unless it was preempted 3 times
    already: then the next latest. Counters: per request, in all and by kind."""
    s = _sched(8)
    s.add_request(_req("a", range(4), max_tokens=30, arrival_time=0.0))
    s.add_request(_req("b", range(10, 14), max_tokens=30, arrival_time=1.0))
    b = s.requests["b"]
    b.num_preemptions = 3
    for _ in range(40):
        out = _step(s)
        if out.preempted_ids:
            break
    assert out.preempted_ids == ["a"]  # b, the latest, is spared
    assert s.requests["a"].num_preemptions == 1 and s.num_preemptions == 1
    a = s.requests["a"]
    for _ in range(40):
        out = _step(s)
        if "a" in out.preempted_ids:
            break
    assert a.num_preemptions == 2
    assert s.num_preemptions == a.num_preemptions + b.num_preemptions - 3
    assert s.preemptions_by_kind == {"recompute": s.num_preemptions}


def test_prompt_logprobs_take_no_prefix_hit():
    """Prompt logprobs need every prompt position computed: a cached prefix is not used."""
    s = _sched(32, caching=True)
    s.add_request(_req("a", range(9), max_tokens=1))
    while s.has_unfinished():
        _step(s)
    s.add_request(_req("b", range(9), max_tokens=1, sp={"prompt_logprobs": 0}))
    out = s.schedule()
    assert out.new_reqs[0].num_computed_tokens == 0 and out.num_scheduled == {"b": 9}


def test_a_request_that_must_preempt_itself_is_not_scheduled():
    """a's next token fits its block; b (the latest) needs a third block from a full pool:
    the victim is b itself, which then computes nothing this step."""
    s = _sched(4)
    s.add_request(_req("a", range(7), arrival_time=0.0))
    s.add_request(_req("b", range(10, 18), arrival_time=1.0))
    _step(s)
    assert s.kv.pool.num_free == 0
    out = _step(s)
    assert out.preempted_ids == ["b"] and out.num_scheduled == {"a": 1}


def test_a_paused_request_is_skipped_and_the_rest_run():
    s = _sched(32)
    for i, rid in enumerate("abc"):
        s.add_request(_req(rid, range(10 * i, 10 * i + 3), arrival_time=float(i)))
    _step(s)
    s.set_paused("b", True)
    assert s.schedule().num_scheduled == {"a": 1, "c": 1}


def test_a_request_bigger_than_the_pool_is_aborted_once_nothing_else_runs():
    """40 tokens need 10 blocks of a 4-block pool. While a runs, big waits; once a is done
    and nothing could be scheduled, big ends with finish_reason "length"."""
    s = _sched(4)
    s.add_request(_req("a", range(3), max_tokens=3, arrival_time=0.0))
    s.add_request(_req("big", range(100, 140), arrival_time=1.0))
    finished = {}
    for step in range(10):
        out = s.schedule()
        sampled = {rid: SampledToken(7) for rid, n in out.num_scheduled.items()
                   if s.requests[rid].num_computed_tokens + n == s.requests[rid].num_tokens}
        for o in s.update_from_output(out, sampled):
            if o.finish_reason:
                finished[o.request_id] = (step, o.finish_reason)
        if not s.has_unfinished():
            break
    # a: prefill + 2 decode steps (steps 0-2); step 3 schedules nothing and aborts big,
    # whose output leaves with the next update.
    assert finished == {"a": (2, "length"), "big": (3, "length")}
    assert not s.has_unfinished()


def test_a_deferred_request_does_not_hold_up_the_queue():
    """b shares a's 16-token prompt, whose last block a computes right now: b waits for that
    hit; c, behind it in the queue, is admitted in the same step."""
    s = _sched(32, budget=12, caching=True)
    s.add_request(_req("a", range(16), arrival_time=0.0))
    assert _step(s).num_scheduled == {"a": 12}
    s.add_request(_req("b", list(range(16)) + [50, 51], arrival_time=1.0))
    s.add_request(_req("c", range(60, 63), arrival_time=2.0))
    out = _step(s)
    assert out.num_scheduled == {"a": 4, "c": 3}
    assert s.requests["b"].status == RequestStatus.WAITING
