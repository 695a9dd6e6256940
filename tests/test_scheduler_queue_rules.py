"""The scheduler's message and queue rules without a model (issue 44: mutmut's survivors in
``core/scheduler.py``'s ``table_diff``, the waiting queue and ``_describe``). Each expectation
is the documented rule worked out by hand."""

from __future__ import annotations

import torch

from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_cache_planner import plan_pagefold
from pagefold.core.kv_cache_spec import FullAttentionSpec
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


def test_a_priority_scheduler_aborts_its_best_request_that_can_never_fit():
    """Two requests bigger than the whole pool (4 blocks of 4): nothing runs, and each step
    aborts the queue's head: the better priority first, whatever the arrival order."""
    s = _sched(blocks=4, policy="priority")
    s.add_request(_req("late", n=20, priority=1, arrival=0.0))
    s.add_request(_req("best", n=30, priority=0, arrival=1.0))
    s.schedule()
    assert list(s.requests) == ["late"] and s.requests["late"].status == RequestStatus.WAITING
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
