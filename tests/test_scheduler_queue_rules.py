"""The scheduler's message and queue rules without a model (issue 44: mutmut's survivors in
``core/scheduler.py``'s ``table_diff``, the waiting queue and ``_describe``). Each expectation
is the documented rule worked out by hand."""

from __future__ import annotations

import logging

import pytest
import torch

from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_cache_planner import plan_pagefold
from pagefold.core.kv_cache_spec import FullAttentionSpec, StateComponent, StateSpec
from pagefold.core.sched_output import SampledToken
from pagefold.core.scheduler import Scheduler, table_diff
from pagefold.lora.request import LoRARequest
from pagefold.multimodal.inputs import ImageFeature, MultiModalInputs
from pagefold.request import Request, RequestStatus
from pagefold.sampling_params import SamplingParams

BS = 4
ATTN = FullAttentionSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32)


def _sched(blocks: int = 32, policy: str = "fcfs") -> Scheduler:
    kv = KVCacheManager(plan_pagefold({"a": ATTN}, BS, (blocks + 1) * ATTN.page_bytes(BS)),
                        enable_prefix_caching=False)
    return Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64,
                     policy=policy)


def _req(rid: str, n: int = 3, priority: int = 0, arrival: float = 0.0, **kw) -> Request:
    return Request(rid, list(range(n)), SamplingParams(max_tokens=4), priority=priority,
                   arrival_time=arrival, **kw)


def test_table_diff_sends_the_table_from_its_first_change():
    assert table_diff([1, 2], [1, 2]) is None
    assert table_diff([1, 2], [1, 2, 5]) == (2, [5])
    assert table_diff([1, 2, 3], [1, 9, 3]) == (1, [9, 3])
    assert table_diff([1, 2, 3], [1, 2]) == (2, [])  # shrunk: nothing differs in the overlap
    assert table_diff([1, 2, 3], []) == (0, [])


def test_priority_ties_keep_arrival_order_and_a_pushed_back_request_goes_first():
    """Equal ``(priority, arrival)``: pushed requests keep their order; each request pushed
    to the front goes ahead of every earlier one (the last pushed back leads), as the FCFS
    deque's ``appendleft``; a better priority still leads."""
    s = _sched(policy="priority")
    a, b, c, d = (_req(r) for r in "abcd")
    s.add_request(a)
    s.add_request(b)
    s.waiting.push_front(c)
    s.waiting.push_front(d)
    s.add_request(_req("z", priority=1))
    s.waiting.push_front(e := _req("e", priority=-1))
    assert [r.request_id for r in s.waiting] == ["e", "d", "c", "a", "b", "z"]
    assert s.num_waiting == len(s.waiting) == 6
    assert s.waiting.peek() is e


def test_remove_says_whether_the_request_was_waiting():
    for policy in ("fcfs", "priority"):
        s = _sched(policy=policy)
        a, b = _req("a"), _req("b", arrival=1.0)
        s.add_request(a)
        assert s.waiting.remove(b) is False
        assert s.waiting.remove(a) is True
        assert s.waiting.remove(a) is False and s.num_waiting == 0


def test_a_priority_scheduler_aborts_its_best_request_that_can_never_fit(caplog):
    """Two requests bigger than the whole pool (4 blocks of 4): nothing runs, and each step
    aborts the queue's head: the better priority first, whatever the arrival order."""
    s = _sched(blocks=4, policy="priority")
    s.add_request(_req("late", n=20, priority=1, arrival=0.0))
    s.add_request(_req("best", n=30, priority=0, arrival=1.0))
    best = s.requests["best"]
    with caplog.at_level(logging.ERROR, logger="pagefold.core.scheduler"):
        out = s.schedule()
    assert [r.getMessage() for r in caplog.records] == [
        "request best needs more blocks than the whole pool; aborting it"]
    assert list(s.requests) == ["late"] and s.requests["late"].status == RequestStatus.WAITING
    assert best.status == RequestStatus.FINISHED_LENGTH and s.num_aborted == 0
    outs = s.update_from_output(out, {})
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == \
        [("best", [], "length")]
    s.schedule()
    assert s.requests == {} and s.num_waiting == 0


def test_a_new_request_message_carries_its_eos_images_and_adapter():
    """The first message of a request carries what the runner needs besides its tokens; the
    image (positions 0-1) is reached by the first chunk."""
    s = _sched()
    s.max_loras = 1
    lora = LoRARequest("ad", 3, "/nowhere")
    mm = MultiModalInputs([ImageFeature(0, 2, "img", b"", [0], [1, 1, 1])])
    s.add_request(_req("a", n=5, eos_token_id=2, mm_inputs=mm, lora_request=lora))
    out = s.schedule()
    (nr,) = out.new_reqs
    assert (nr.req_id, nr.prompt_token_ids, nr.eos_token_id, nr.num_computed_tokens) == \
        ("a", [0, 1, 2, 3, 4], 2, 0)
    assert nr.mm_inputs is mm and nr.lora_request is lora and nr.block_ids == [[1, 2]]


def _preempting_steps(caplog, counts: dict[str, int]) -> list[list[str]]:
    """a (7 tokens) and b (8) fill a pool of 4 blocks; at the second step b needs a third block
    and is its own victim (recompute): 1 running, 1 waiting, b's 2 blocks free. The third
    step preempts nothing (a takes 1 of the 2 free blocks, b needs 3). ``counts``: the
    scheduler's preemption counters before, as if earlier steps had preempted."""
    s = _sched(blocks=4)
    s.preemptions_by_kind = dict(counts)
    s.add_request(_req("a", n=7))
    s.add_request(_req("b", n=8, arrival=1.0))
    logs = []
    for _ in range(3):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pagefold.core.scheduler"):
            out = s.schedule()
        s.update_from_output(out, {rid: SampledToken(7) for rid, n in out.num_scheduled.items()
                                   if s.requests[rid].num_computed_tokens + n
                                   == s.requests[rid].num_tokens})
        logs.append([r.getMessage() for r in caplog.records
                     if r.name == "pagefold.core.scheduler"])
    return logs


def test_a_step_that_preempts_logs_one_line_with_this_steps_counts(caplog):
    line = ("preempted 1 request(s) this step (1 by recompute); 1 running, 1 waiting, "
            "2 free blocks")
    assert _preempting_steps(caplog, {}) == [[], [line], []]
    # Earlier preemptions count only in the counters, not in this step's line.
    assert _preempting_steps(caplog, {"recompute": 5, "swap": 2}) == [[], [line], []]


def test_only_aborts_count_and_a_finished_id_can_be_reused():
    """``num_aborted`` counts aborts only; a finished request's id names a new request whose
    first message is a new request's (the runner dropped the old one)."""
    s = _sched()
    for rid in "abc":
        s.add_request(_req(rid))
    out = s.schedule()
    assert s.prompt_tokens_computed == 0
    s.update_from_output(out, {})
    assert s.prompt_tokens_computed == 9
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    s.finish_request("b", RequestStatus.FINISHED_STOPPED)
    assert s.num_aborted == 1
    s.finish_request("c", RequestStatus.FINISHED_ABORTED)
    assert s.num_aborted == 2
    s.add_request(_req("a", n=5))
    out = s.schedule()
    assert [r.req_id for r in out.new_reqs] == ["a"] and out.cached_reqs == []


def test_a_forked_request_copies_its_parent():
    s = _sched()
    s.max_loras = 1
    lora = LoRARequest("ad", 3, "/nowhere")
    mm = MultiModalInputs([ImageFeature(0, 2, "img", b"", [0], [1, 1, 1])])
    s.add_request(_req("p", n=5, priority=3, arrival=0.5, eos_token_id=2, mm_inputs=mm,
                       lora_request=lora, extra_keys=("salt",)))
    out = s.schedule()
    s.update_from_output(out, {"p": SampledToken(7, logprobs=([7], [-1.5], 1))})
    c = s.fork_request("p", "c")
    assert (c.eos_token_id, c.arrival_time, c.priority, c.extra_keys) == (2, 0.5, 3, ("salt",))
    assert (c.all_token_ids, c.output_token_ids, c.cumulative_logprob) == \
        ([0, 1, 2, 3, 4, 7], [7], -1.5)
    assert c.mm_inputs is mm and c.lora_request is lora and c.num_cached_tokens == 0
    assert c.status == RequestStatus.RUNNING and s.running == [s.requests["p"], c]


def test_fork_request_refusals_name_the_problem():
    s = _sched()
    s.add_request(_req("p"))
    s.add_request(_req("q"))
    with pytest.raises(ValueError, match=r"^request id 'q' is already in use$"):
        s.fork_request("p", "q")
    s.max_in_flight = 2
    s.schedule()
    with pytest.raises(RuntimeError, match=r"^request 'p' is in a step in flight; fork it after$"):
        s.fork_request("p", "c")


def test_a_fork_without_a_free_block_is_refused():
    """A state-only model (a state is one 256-byte page): the pool's one usable page holds the
    parent's state, and a child needs its own copy of it now."""
    state = StateSpec("gdn", (StateComponent("ssm", (64,), torch.float32),))
    kv = KVCacheManager(plan_pagefold({"s": state}, BS, 2 * 256), enable_prefix_caching=False)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    s.add_request(_req("p", n=5))
    s.schedule()
    assert s.kv.pool.num_free == 0
    with pytest.raises(RuntimeError,
                       match=r"^no free blocks to fork a request; lower beam_width or n$"):
        s.fork_request("p", "c")


def test_a_step_that_preempts_by_two_kinds_names_both(caplog):
    """Three 4-token prompts fill a pool of 3 blocks; swap mode with a host pool of one page.
    At the second step ``a`` needs a block: the victim ``c`` (the latest) swaps out to the
    host's one page; then ``b`` needs one: the victim is ``b`` itself, and with the host full
    it is recomputed. One line for both, kinds sorted by name."""
    s = _sched(blocks=3)
    s.kv.attach_swap(1, "swap", None)
    for rid in "abc":
        s.add_request(_req(rid, n=4))
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pagefold.core.scheduler"):
            out = s.schedule()
        s.update_from_output(out, {rid: SampledToken(7) for rid in out.num_scheduled})
    assert out.preempted_ids == ["c", "b"]
    assert [r.getMessage() for r in caplog.records if r.name == "pagefold.core.scheduler"] == [
        "preempted 2 request(s) this step (1 by recompute, 1 by swap); 1 running, 2 waiting, "
        "1 free blocks"]


def test_a_request_that_preempts_itself_leaves_the_rest_of_the_step_to_the_others():
    """Priority policy, a pool of 3 blocks. ``b`` (priority 5, the worst) runs first and
    alone; ``a`` and ``c`` join it, one block each: the pool is full. At the third step ``b``
    needs a second block and is its own victim: it computes nothing, and the requests after
    it in the running list (``a``, ``c``: their next token fits their block) still run."""
    s = _sched(blocks=3, policy="priority")
    s.add_request(_req("b", priority=5))
    steps = []
    for k in range(3):
        if k == 1:
            s.add_request(_req("a", priority=0, arrival=1.0))
            s.add_request(_req("c", priority=1, arrival=2.0))
        out = s.schedule()
        steps.append((out.num_scheduled, out.preempted_ids))
        s.update_from_output(out, {rid: SampledToken(7) for rid in out.num_scheduled})
    assert steps == [({"b": 3}, []), ({"b": 1, "a": 3, "c": 3}, []),
                     ({"a": 1, "c": 1}, ["b"])]
