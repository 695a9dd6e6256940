"""The scheduler's pipelined steps and step bookkeeping without a model (issue 44: mutmut's
survivors in ``Scheduler.schedule`` / ``update_from_output``). A real ``Scheduler`` over a
small pool, driven message by message as ``engine/batch_queue.py`` drives it with
``max_in_flight`` P > 1: a request in an unapplied message is skipped, a message takes at most
``ceil(running / P)`` running requests, nothing is preempted while a message is in flight (the
schedule stops and sets ``drain``), and each applied message unpins the copies of the oldest
message only. Then the step's bookkeeping: the prompt-token counter, an output's cached
tokens, the connector ops' ``idle`` flag and a verify step's undrafted request. Every
expectation is the documented rule worked out by hand."""

from __future__ import annotations

import torch

from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_cache_planner import plan_pagefold
from pagefold.core.kv_cache_spec import FullAttentionSpec, StateComponent, StateSpec
from pagefold.core.sched_output import SampledToken, SchedulerOutput, VerifiedTokens
from pagefold.core.scheduler import Scheduler
from pagefold.offload.index import OffloadIndex
from pagefold.request import Request, RequestStatus
from pagefold.sampling_params import SamplingParams

BS = 4
ATTN = FullAttentionSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32)


def _sched(blocks: int, in_flight: int = 1) -> Scheduler:
    """An attention pool of ``blocks`` usable blocks of 4 tokens (block 0 is the null block)."""
    kv = KVCacheManager(plan_pagefold({"a": ATTN}, BS, (blocks + 1) * ATTN.page_bytes(BS)),
                        enable_prefix_caching=False)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    s.max_in_flight = in_flight
    return s


def _add(s: Scheduler, rid: str, n: int, max_tokens: int = 8, arrival: float = 0.0) -> Request:
    req = Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens),
                  arrival_time=arrival)
    s.add_request(req)
    return req


def _step(s: Scheduler) -> SchedulerOutput:
    """``schedule()``: every call returns the whole step as a message (the engine submits
    it even when it computes nothing: its copies and pins are paired with it)."""
    out = s.schedule()
    assert isinstance(out, SchedulerOutput)
    return out


def _tokens(out, tok: int = 50) -> dict[str, SampledToken]:
    """A sampled token for every request of ``out`` (each chunk reaches its prompt's end)."""
    return {rid: SampledToken(tok) for rid in out.num_scheduled}


def test_a_message_takes_its_share_of_the_running_requests_and_skips_those_in_flight():
    """P = 2, three requests. Admission is not seat-limited: the first message prefills all
    three, and a second one made before it is applied finds nothing to do. Once they decode,
    a message takes ceil(3 / 2) = 2 of them (in running order), the next one the third; a
    message applied frees its requests for the next."""
    s = _sched(blocks=16, in_flight=2)
    a, b, c = (_add(s, rid, 3) for rid in "abc")
    m1 = _step(s)
    assert m1.num_scheduled == {"a": 3, "b": 3, "c": 3}
    assert list(s.in_flight) == ["a", "b", "c"]
    m2 = _step(s)
    assert m2.num_scheduled == {} and s.drain is False
    s.update_from_output(m1, _tokens(m1))
    assert s.in_flight == {}
    assert [(r.num_computed_tokens, r.num_tokens) for r in (a, b, c)] == [(3, 4)] * 3
    s.update_from_output(m2, {})
    m3 = _step(s)
    assert s.in_flight == {"a": a, "b": b}
    assert m3.num_scheduled == {"a": 1, "b": 1}
    m4 = _step(s)
    assert m4.num_scheduled == {"c": 1}
    assert s.in_flight == {"a": a, "b": b, "c": c}
    outs = s.update_from_output(m3, _tokens(m3, 51))
    assert [(o.request_id, o.new_token_ids) for o in outs] == [("a", [51]), ("b", [51])]
    assert s.in_flight == {"c": c}
    assert [r.num_computed_tokens for r in (a, b, c)] == [4, 4, 3]
    m5 = _step(s)  # c is still in flight: a and b again
    assert m5.num_scheduled == {"a": 1, "b": 1}
    s.update_from_output(m4, _tokens(m4, 52))
    s.update_from_output(m5, _tokens(m5, 53))
    assert [r.output_token_ids for r in (a, b, c)] == [[50, 51, 53], [50, 51, 53], [50, 52]]
    assert s.in_flight == {}


def test_seats_round_up_and_one_message_in_flight_means_no_pipeline():
    """Five decoding requests: P = 2 gives messages of ceil(5 / 2) = 3 and 2, P = 3 of 2, 2
    and 1. At P = 1 (no pipeline) a message takes every request and nothing is in flight."""
    for p, sizes in ((2, [3, 2]), (3, [2, 2, 1])):
        s = _sched(blocks=16, in_flight=p)
        for rid in "abcde":
            _add(s, rid, 3)
        m = _step(s)
        s.update_from_output(m, _tokens(m))
        msgs = [_step(s) for _ in sizes]
        assert [len(m.num_scheduled) for m in msgs] == sizes
        assert [rid for m in msgs for rid in m.num_scheduled] == list("abcde")
    s = _sched(blocks=16, in_flight=1)
    for rid in "abcde":
        _add(s, rid, 3)
    m = _step(s)
    assert s.in_flight == {}
    s.update_from_output(m, _tokens(m))
    m = _step(s)
    assert m.num_scheduled == dict.fromkeys("abcde", 1) and s.in_flight == {}


def test_a_result_for_an_aborted_request_is_dropped_even_when_its_id_is_reused():
    """P = 2: ``a`` is aborted while its message is in flight and a new request takes its
    id. The new one waits (its id is in flight), the old message's token is not applied to
    it, and it is admitted from scratch once that message is applied."""
    s = _sched(blocks=16, in_flight=2)
    _add(s, "a", 3)
    b = _add(s, "b", 2)
    m1 = _step(s)
    assert m1.num_scheduled == {"a": 3, "b": 2}
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    new = _add(s, "a", 5)
    m2 = _step(s)
    assert m2.num_scheduled == {} and list(s.waiting) == [new]
    outs = s.update_from_output(m1, _tokens(m1))
    assert [(o.request_id, o.new_token_ids) for o in outs] == [("b", [50])]
    assert new.num_computed_tokens == 0 and new.output_token_ids == []
    assert s.in_flight == {} and b.num_computed_tokens == 2
    s.update_from_output(m2, {})
    m3 = _step(s)
    assert m3.num_scheduled == {"b": 1, "a": 5}
    assert [nr.req_id for nr in m3.new_reqs] == ["a"]


def test_a_block_shortage_while_a_message_is_in_flight_drains_then_preempts_as_without_one():
    """P = 2, a pool of 4 blocks: ``a`` (4 tokens), ``b`` (3) and ``c`` (4) take a block each.
    Decoding, the first message takes 2 seats: ``a`` needs its second block (the last free
    one), ``b`` fits in its own. The next message reaches ``c``, which needs a block: with a
    message in flight nothing is preempted; the schedule stops and sets ``drain``. Once both
    are applied (nothing in flight) the next message preempts as the scheduler without a
    pipeline does: ``b`` needs a block and the victim is the latest arrival, ``c``."""
    s = _sched(blocks=4, in_flight=2)
    a, b, c = _add(s, "a", 4), _add(s, "b", 3, arrival=1.0), _add(s, "c", 4, arrival=2.0)
    m1 = _step(s)
    s.update_from_output(m1, _tokens(m1))
    assert s.kv.pool.num_free == 1
    m2 = _step(s)
    assert m2.num_scheduled == {"a": 1, "b": 1} and s.kv.pool.num_free == 0
    w = _add(s, "w", 1, arrival=3.0)  # waits: no admission in a drained schedule
    m3 = _step(s)
    assert s.drain is True
    assert m3.num_scheduled == {} and m3.preempted_ids == []
    assert s.running == [a, b, c] and c.status == RequestStatus.RUNNING
    assert c.num_computed_tokens == 4 and list(s.waiting) == [w]
    assert s.in_flight == {"a": a, "b": b}
    s.update_from_output(m2, _tokens(m2, 51))
    s.update_from_output(m3, {})
    m4 = _step(s)
    assert s.drain is False
    assert m4.preempted_ids == ["c"] and m4.num_scheduled == {"a": 1, "b": 1}
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert list(s.waiting) == [c, w]
    s.update_from_output(m4, _tokens(m4, 52))


def test_a_shortage_with_nothing_in_flight_preempts_at_once():
    """P = 2, a pool of 2 blocks, ``a`` and ``b`` of 4 tokens each: the first decode message
    (nothing in flight) gives ``a`` its second block by preempting ``b`` (the latest), and does
    not drain."""
    s = _sched(blocks=2, in_flight=2)
    a, b = _add(s, "a", 4), _add(s, "b", 4, arrival=1.0)
    m1 = _step(s)
    s.update_from_output(m1, _tokens(m1))
    m2 = _step(s)
    assert s.drain is False
    assert m2.preempted_ids == ["b"] and m2.num_scheduled == {"a": 1}
    assert s.running == [a] and list(s.waiting) == [b]


def test_an_applied_message_unpins_only_the_copies_of_the_oldest_message():
    """P = 2 on a state-only model with prefix caching (a state is one page; checkpoints every
    8 tokens). ``a``'s 9-token prompt is cut at its checkpoint target, 8; applying that chunk
    saves the checkpoint into a new page, pinned (ref 1) until the copy runs and held by ``a``
    as its newest checkpoint (ref 2). The copy leaves with the next message made (m3: one seat
    of ceil(2 / 2), ``a``'s) while an empty one (m2) is still in flight: applying m2 must not
    unpin m3's page; applying m3 does."""
    state = StateSpec("gdn", (StateComponent("ssm", (64,), torch.float32),))
    kv = KVCacheManager(plan_pagefold({"s": state}, BS, 9 * 256), enable_prefix_caching=True,
                        checkpoint_interval=8)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    s.max_in_flight = 2
    a, b = _add(s, "a", 9), _add(s, "b", 2, arrival=1.0)
    m1 = _step(s)
    assert m1.num_scheduled == {"a": 8, "b": 2} and m1.copies == []
    m2 = _step(s)
    assert m2.num_scheduled == {} and m2.copies == []
    s.update_from_output(m1, {"b": SampledToken(50)})
    m3 = _step(s)
    assert m3.num_scheduled == {"a": 1}  # one seat of ceil(2 / 2)
    (copy,) = m3.copies
    (dst,) = copy.dst
    pool = s.kv.pool
    assert pool.blocks[dst].ref_cnt == 2
    s.update_from_output(m2, {})
    assert pool.blocks[dst].ref_cnt == 2  # m3 has not run: its copy's page stays pinned
    s.update_from_output(m3, _tokens(m3))
    assert pool.blocks[dst].ref_cnt == 1
    assert a.num_computed_tokens == 9 and b.num_computed_tokens == 2


def test_the_prompt_token_counter_counts_prompt_positions_computed_again_after_a_recompute():
    """``prompt_tokens_computed`` counts prompt positions the forwards computed. A pool of 4
    blocks: ``a`` (7 tokens, 2 tokens to generate) and ``b`` (8) prefill: 15. Decoding, ``a``
    computes 1 token (no prompt position: still 15) and ``b`` needs a third block: it is its
    own victim (recompute). ``a`` finishes; ``b`` comes back with its 8 prompt tokens and its
    sampled one, 9 computed in one chunk of which 8 are prompt positions: 23. Its decode
    steps add nothing."""
    s = _sched(blocks=4)
    a, b = _add(s, "a", 7, max_tokens=2), _add(s, "b", 8, arrival=1.0)
    counts = []
    for _ in range(4):
        out = _step(s)
        s.update_from_output(out, _tokens(out))
        counts.append((out.num_scheduled, s.prompt_tokens_computed))
    assert counts == [({"a": 7, "b": 8}, 15), ({"a": 1}, 15), ({"b": 9}, 23), ({"b": 1}, 23)]
    assert a.status == RequestStatus.FINISHED_LENGTH and b.num_preemptions == 1


def test_an_output_reports_the_tokens_its_request_found_cached():
    """``num_cached_tokens`` on every output: 0 for a prompt without a prefix hit, the hit's
    length (whole blocks) for one that had it."""
    kv = KVCacheManager(plan_pagefold({"a": ATTN}, BS, 17 * ATTN.page_bytes(BS)),
                        enable_prefix_caching=True)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    _add(s, "a", 9)
    out = _step(s)
    (o,) = s.update_from_output(out, _tokens(out))
    assert (o.request_id, o.num_cached_tokens) == ("a", 0)
    _add(s, "b", 9)  # the same prompt: its first two blocks (8 tokens) are cached
    out = _step(s)
    assert out.num_scheduled == {"a": 1, "b": 1}
    outs = s.update_from_output(out, _tokens(out))
    assert [(o.request_id, o.num_cached_tokens) for o in outs] == [("a", 0), ("b", 8)]


def test_the_connector_ops_say_idle_only_when_the_step_computes_and_copies_nothing():
    """With a KV connector (offload tiers) each step's ops carry ``idle``: the step has no
    tokens, no page copies and no swaps (the worker may then wait for a load). A state-only
    model, checkpoints at block boundaries: an empty step is idle; a prefill is not; ``a``'s
    last decode step reaches the boundary at 4 and finishes, so its checkpoint's copy waits
    for the next step, which has no tokens but is not idle."""
    state = StateSpec("gdn", (StateComponent("ssm", (64,), torch.float32),))
    kv = KVCacheManager(plan_pagefold({"s": state}, BS, 9 * 256), enable_prefix_caching=True,
                        checkpoint_interval=8)
    kv.attach_connector(OffloadIndex(host_slots=4, page_bytes=kv.config.page_bytes,
                                     group_layers=[1]))
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    out = _step(s)
    assert out.kv_ops.idle is True
    s.update_from_output(out, {})
    a = _add(s, "a", 3, max_tokens=2)
    idle, copies = [], []
    for _ in range(3):
        out = _step(s)
        idle.append(out.kv_ops.idle)
        copies.append(len(out.copies))
        s.update_from_output(out, _tokens(out))
    assert idle == [False, False, False] and copies == [0, 0, 1]
    assert out.num_scheduled == {} and a.status == RequestStatus.FINISHED_LENGTH
    out = _step(s)
    assert out.kv_ops.idle is True and out.copies == []


def test_a_verify_step_applies_a_request_without_drafts_as_one_token():
    """A verify step returns ``VerifiedTokens`` for every request that reached the end of its
    tokens, drafted or not. ``a`` (decoding, drafts [7, 8]) computes 3 tokens and keeps
    1 + 1 accepted: 5 computed, 7 and 9 appended. ``b``'s prompt (4 tokens) ends in the same
    step with no drafts: all 4 stand and its one token is appended."""
    s = _sched(blocks=16)
    a = _add(s, "a", 3)
    out = _step(s)
    s.update_from_output(out, _tokens(out))
    b = _add(s, "b", 4)
    s.spec_token_ids = {"a": [7, 8]}  # as the drafter proposes at the start of a step
    out = _step(s)
    assert out.num_scheduled == {"a": 3, "b": 4} and out.spec_token_ids == {"a": [7, 8]}
    outs = s.update_from_output(out, {"a": VerifiedTokens([7, 9], 1),
                                      "b": VerifiedTokens([5], 0)})
    assert [(o.request_id, o.new_token_ids) for o in outs] == [("a", [7, 9]), ("b", [5])]
    assert (a.num_computed_tokens, a.output_token_ids) == (5, [50, 7, 9])
    assert (b.num_computed_tokens, b.output_token_ids) == (4, [5])
