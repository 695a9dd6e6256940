"""``KVCacheManager``'s own rules at their edges, on a stand-in model (issue 44: mutmut's
survivors in ``core/kv_cache_manager.py``): the ``auto`` preemption mode's cost comparison
and its decision log, the in-flight deferral's boundary, where prefill chunks are cut for
state checkpoints. Every expected number is worked out by hand from the documented rule."""

from __future__ import annotations

import logging

import pytest
import torch

from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_cache_planner import plan_pagefold
from pagefold.core.kv_cache_spec import FullAttentionSpec, StateComponent, StateSpec
from pagefold.core.sched_output import SampledToken
from pagefold.core.scheduler import Scheduler
from pagefold.core.swap import PreemptionCost
from pagefold.request import Request, RequestStatus
from pagefold.sampling_params import SamplingParams

BS = 4
ATTN = FullAttentionSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32)  # 128-byte page
STATE = StateSpec("gdn", (StateComponent("ssm", (64,), torch.float32),))  # two pages
PAGE = ATTN.page_bytes(BS)


def _sched(specs: dict, blocks: int = 40, budget: int = 64, caching: bool = False,
           interval: int = 256) -> Scheduler:
    kv = KVCacheManager(plan_pagefold(specs, BS, (blocks + 1) * PAGE),
                        enable_prefix_caching=caching, checkpoint_interval=interval)
    return Scheduler(kv, max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=128)


def _req(rid: str, prompt, max_tokens: int = 8, **kw) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   **kw)


def _step(s: Scheduler):
    out = s.schedule()
    s.update_from_output(out, {rid: SampledToken(7) for rid, n in out.num_scheduled.items()
                               if s.requests[rid].num_computed_tokens + n
                               == s.requests[rid].num_tokens})
    return out


# ---------------------------------------------------------------- auto preemption
@pytest.mark.parametrize("caching, flops, bandwidth, kind", [
    # a: a 10-token prompt computed in one step (3 blocks of 128 bytes: 384 bytes to move,
    # a swap costs 2 x 384 / bandwidth seconds); a recompute flops / 2 seconds per token
    # redone (a compute rate of 2 FLOP/s).
    (True, 2.0, 384.0, "recompute"),  # 2 tokens to redo (8 credited: 2 cached blocks): 2 s
    (True, 2.0, 768.0, "swap"),  # swap 1 s < 2 s
    (False, 2.0, 384.0, "swap"),  # no credit: 10 s to redo > 2 s
    (False, 0.5, 384.0, "swap"),  # 2.5 s > 2 s
    (False, 0.25, 384.0, "recompute"),  # 1.25 s < 2 s
])
def test_auto_mode_takes_the_cheaper_preemption(caching, flops, bandwidth, kind, caplog):
    s = _sched({"attn": ATTN}, caching=caching)
    s.kv.attach_swap(16, "auto", PreemptionCost(flops_per_token=flops, compute_rate=2.0,
                                                link_bandwidth=bandwidth))
    s.add_request(_req("a", range(10)))
    _step(s)
    kv, a = s.kv, s.requests["a"]
    assert a.num_computed_tokens == 10
    with caplog.at_level(logging.DEBUG, logger="pagefold.core.kv_cache_manager"):
        assert kv.preempt(a) == kind
    credit = 8 if caching else 0
    log = kv.preempt_log
    assert log.decisions == [("a", kind, 3 * PAGE, 10 - credit)]
    assert (log.swap, log.recompute) == ((1, 0) if kind == "swap" else (0, 1))
    assert (log.recomputed_tokens, log.credited_tokens) == (
        (0, 0) if kind == "swap" else (10, credit))
    assert a.num_computed_tokens == (10 if kind == "swap" else 0)
    assert kv.host.num_free == (16 - 3 if kind == "swap" else 16)
    assert caplog.messages[-1] == (
        f"preempting a by {kind}: {3 * PAGE} bytes to move vs {10 - credit} tokens to "
        f"recompute ({credit} tokens creditable from the prefix cache)")


def test_swap_and_recompute_modes_ignore_the_costs():
    """``swap`` swaps where a recompute would cost nothing; ``recompute`` recomputes where a
    swap would cost nothing."""
    for mode, flops, bandwidth in (("swap", 1e-9, 1.0), ("recompute", 1.0, 1e12)):
        s = _sched({"attn": ATTN})
        s.kv.attach_swap(16, mode, PreemptionCost(flops_per_token=flops, compute_rate=1.0,
                                                  link_bandwidth=bandwidth))
        s.add_request(_req("a", range(10)))
        _step(s)
        assert s.kv.preempt(s.requests["a"]) == mode


def test_a_swap_moves_every_layer_of_its_pages():
    """Two attention layers share one group: a page is one block of each layer, so a's 3
    pages move 3 x 2 x 128 bytes each way."""
    kv = KVCacheManager(plan_pagefold({"l0": ATTN, "l1": ATTN}, BS, 41 * 2 * PAGE))
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128)
    kv.attach_swap(16, "swap", PreemptionCost(flops_per_token=1.0))
    s.add_request(_req("a", range(10)))
    _step(s)
    assert kv.preempt(s.requests["a"]) == "swap"
    assert kv.preempt_log.decisions == [("a", "swap", 3 * 2 * PAGE, 10)]
    assert (kv.swap_stats.swaps_out, kv.swap_stats.bytes_out) == (1, 3 * 2 * PAGE)


def test_the_preemption_log_counts_every_decision_and_keeps_the_last_256():
    """Recomputes of prompts of 10, 11, 12 tokens (cached: 2, 2, 3 full blocks of the
    tokens but the last: 8 + 8 + 12 credited), then two swap-outs and swap-ins of a 10-token
    request (3 pages each way)."""
    s = _sched({"attn": ATTN}, caching=True)
    kv = s.kv
    for i in range(3):
        s.add_request(_req(f"a{i}", range(100 * i, 100 * i + 10 + i)))
        _step(s)
        kv.preempt(s.requests[f"a{i}"])
        s.finish_request(f"a{i}", RequestStatus.FINISHED_ABORTED)
    log = kv.preempt_log
    assert (log.recompute, log.swap, log.recomputed_tokens, log.credited_tokens) == (
        3, 0, 10 + 11 + 12, 8 + 8 + 12)
    for i in range(300):  # nothing held: each is logged all the same
        kv.preempt(_req(f"x{i}", range(5)))
    assert len(log.decisions) == 256
    assert log.decisions[0] == ("x44", "recompute", 0, 0)
    assert log.decisions[-1] == ("x299", "recompute", 0, 0)
    assert log.recompute == 303
    kv.caching = False
    kv.attach_swap(8, "swap", PreemptionCost(flops_per_token=1.0))
    s.add_request(_req("b", range(500, 510)))
    _step(s)
    for _ in range(2):
        s._preempt(s.requests["b"])
        _step(s)  # b comes back
    assert (log.recompute, log.swap) == (303, 2) and len(log.decisions) == 256
    assert (kv.swap_stats.swaps_out, kv.swap_stats.swaps_in) == (2, 2)
    assert (kv.swap_stats.bytes_out, kv.swap_stats.bytes_in) == (6 * PAGE, 6 * PAGE)


# ---------------------------------------------------------------- in-flight deferral
@pytest.mark.parametrize("extra, waits", [
    ([], False),  # b = a's prompt: its last token is in block 3, which b computes itself
    ([50], True),  # one token more: block 3 is a full block of b's prefix, a computes it now
    ([50, 51, 52, 53], True),
])
def test_a_prompt_waits_only_for_a_block_it_could_hit(extra, waits):
    """a's 16-token prompt runs in chunks of 12 and 4 (budget 12). After a's first step,
    blocks 0-2 are cached and block 3 is in flight. b shares the 16 tokens: b (hit 3 blocks)
    is deferred only when block 3 lies inside its hittable prefix, (len(b) - 1) // 4 > 3."""
    s = _sched({"attn": ATTN}, budget=12, caching=True)
    s.add_request(_req("a", range(16), arrival_time=0.0))
    assert _step(s).num_scheduled == {"a": 12}
    s.add_request(_req("b", list(range(16)) + extra, arrival_time=1.0))
    out = _step(s)
    if waits:
        assert out.num_scheduled == {"a": 4}
        assert s.requests["b"].status == RequestStatus.WAITING
        out = _step(s)  # a's last block has landed: b hits 4 blocks
    assert out.num_scheduled["b"] == 16 + len(extra) - (16 if waits else 12)
    assert [r.num_computed_tokens for r in out.new_reqs if r.req_id == "b"] == [
        16 if waits else 12]


def test_a_request_is_never_deferred_by_its_own_promise_or_once_it_computed():
    """The promise a request made at admission never defers it (a request whose hit is
    loading has computed nothing yet); nor is a request with computed tokens (a swapped-out
    one resumes from its own pages) deferred by another's promise."""
    s = _sched({"attn": ATTN}, budget=12, caching=True)
    kv = s.kv
    s.add_request(_req("a", range(16)))
    _step(s)
    b = _req("b", range(20))
    kv.find_hit(b)
    kv.record_admission(b, 0)  # b promises blocks 3 and 4 (a promised block 3 first)
    assert kv.should_defer(b)  # block 3 is a's
    c = _req("c", list(range(12)) + [99] * 8)
    kv.find_hit(c)
    kv.record_admission(c, 12)  # c's own block 3 onward
    assert not kv.should_defer(c)
    d = _req("d", range(20))
    d.num_computed_tokens = 4
    assert not kv.should_defer(d)
    assert not _sched({"attn": ATTN}).kv.should_defer(_req("e", range(20)))


# ---------------------------------------------------------------- checkpoint targets
def _chunks(s: Scheduler, rid: str) -> list[int]:
    """The chunks of ``rid``'s prompt, one step each, until its prompt is computed (or it
    finished: one sampled token)."""
    got = []
    while rid in s.requests and (s.requests[rid].num_computed_tokens
                                 < s.requests[rid].num_prompt_tokens):
        got.append(_step(s).num_scheduled[rid])
    return got


@pytest.mark.parametrize("length, interval, chunks", [
    # targets: every `interval` up to len - 1, the last boundary at or below len - 1 and the
    # one 3 blocks before it; a chunk ends on each.
    (23, 8, [8, 8, 4, 3]),  # {8, 16} | {20, 8}
    (23, 256, [8, 12, 3]),  # {} | {20, 8}
    (21, 256, [8, 12, 1]),  # len - 1 = 20 is a boundary itself: {20, 8}
    (20, 256, [4, 12, 4]),  # len - 1 = 19: {16, 4}
    (13, 4, [4, 4, 4, 1]),  # {4, 8, 12} | {12, 0}
    (9, 256, [8, 1]),  # {8} | 8 - 12 < 0
])
def test_prefill_chunks_end_on_the_checkpoint_targets(length, interval, chunks):
    s = _sched({"attn": ATTN, "state": STATE}, caching=True, interval=interval)
    s.add_request(_req("a", range(length)))
    assert _chunks(s, "a") == chunks


def test_a_hit_short_of_the_attention_prefix_adds_a_target_where_it_ended():
    """a (30 tokens) leaves checkpoints at its targets 16 and 28 (and attention blocks up to
    28). b shares a's first 22 tokens: its attention hit is 5 blocks (20 tokens), its state
    hit the checkpoint at 16, so b resumes at 16 with targets 20 (where the attention hit
    ended), 24 and 36 (len(b) - 1 = 39): chunks 4, 4, 12, 4."""
    s = _sched({"attn": ATTN, "state": STATE}, caching=True)
    s.add_request(_req("a", range(30), max_tokens=1))
    assert _chunks(s, "a") == [16, 12, 2]
    assert not s.has_unfinished() and s.kv.pool.checkpoint_stats()[0] == 2
    s.add_request(_req("b", list(range(22)) + [99] * 18, max_tokens=1))
    out = _step(s)
    assert [r.num_computed_tokens for r in out.new_reqs] == [16]
    assert out.num_scheduled == {"b": 4}
    assert [4] + _chunks(s, "b") == [4, 4, 12, 4]


# ---------------------------------------------------------------- eviction order
def test_the_least_recently_used_prefix_is_evicted_first():
    """The scheduler advances the pool's clock once per step, and a cached block's eviction
    score is the step it was last used plus its saved tokens (4 per attention block). a's
    block 0 is cached in step 1 and held by a until step 3; b's, cached in step 2, is freed
    at once (b stops after one token). Freed later but used earlier, a's block goes first
    when c needs all but one of the 8 blocks."""
    s = _sched({"attn": ATTN}, blocks=8, caching=True)
    a, b = _req("a", range(5), max_tokens=3), _req("b", range(20, 25), max_tokens=1)
    s.add_request(a)
    _step(s)
    s.add_request(b)
    _step(s)
    _step(s)
    assert not s.has_unfinished() and s.kv.pool.num_free == 8
    a0, b0 = (0, a.block_hashes[0]), (0, b.block_hashes[0])
    assert set(s.kv.pool.entries) == {a0, b0}
    s.add_request(_req("c", range(40, 65), max_tokens=1))  # 25 tokens: 7 blocks
    assert _step(s).num_scheduled == {"c": 25}
    assert s.kv.pool.entry(a0) is None and s.kv.pool.entry(b0) is not None


# ---------------------------------------------------------------- swap
def test_a_swapped_request_comes_back_with_exactly_the_blocks_it_needs_free():
    """4 blocks. a (8 tokens: 2 blocks) and b (3 tokens: 1 block) run; a is swapped out.
    Back, a needs its 2 pages plus a block for position 8: 3, exactly what is free while b
    decodes inside its block."""
    s = _sched({"attn": ATTN}, blocks=4)
    s.kv.attach_swap(8, "swap", PreemptionCost(flops_per_token=1.0))
    s.add_request(_req("a", range(8), arrival_time=0.0))
    s.add_request(_req("b", range(20, 23), arrival_time=1.0))
    _step(s)
    s._preempt(s.requests["a"])
    assert s.kv.pool.num_free == 3 and s.kv.host.num_free == 6
    out = _step(s)
    assert out.num_scheduled == {"b": 1, "a": 1}
    assert [(r.req_id, r.num_computed_tokens) for r in out.new_reqs] == [("a", 8)]
    assert s.kv.pool.num_free == 0 and s.kv.host.num_free == 8


def test_the_host_pool_refuses_what_it_lacks_and_finds_a_row_held_or_freed_twice():
    from pagefold.core.swap import HostPool

    h = HostPool(2)
    rows = h.allocate(2)
    assert sorted(rows) == [0, 1] and h.num_free == 0
    with pytest.raises(RuntimeError, match=r"^host pool: asked for 1 blocks, 0 free$"):
        h.allocate(1)
    h.free([rows[0]])
    with pytest.raises(AssertionError, match="^host pool blocks still held$"):
        h.check_whole()  # one row still out
    h.free([rows[0]])  # freed twice: two rows listed, one of them twice
    with pytest.raises(AssertionError, match="^host pool blocks still held$"):
        h.check_whole()


def test_a_deep_checkpoint_outlives_a_newer_block_by_its_saved_tokens():
    """The score weighs recency (one per step) against saved tokens per page. A hybrid (an
    attention page per 4 tokens, a 2-page state), 20 blocks. x (17 tokens; targets 4 and
    16) leaves, with the step each was made: its checkpoint at 4 (step 1, 4 tokens over 2
    pages: score 1 + 2 = 3), block 0 (step 1: 1 + 4 = 5), blocks 1-3 (step 2: 6) and the
    checkpoint at 16 (step 2: 2 + 16 / 2 = 10). y (5 tokens) adds its checkpoint at 4 (step
    4: 4 + 2 = 6) and its block 0 (step 4: 4 + 4 = 8). 11 pages cached, 9 plain. Six 3-token
    requests (a block and a state each: 18 pages) evict 9 pages in score order: everything
    but x's checkpoint at 16. (Two steps per tick would score y's block 8 + 4 = 12, x's
    checkpoint 4 + 8 = 12, and evict the checkpoint first.)"""
    s = _sched({"attn": ATTN, "state": STATE}, blocks=20, caching=True)
    x, y = _req("x", range(17), max_tokens=1), _req("y", range(100, 105), max_tokens=1)
    for r, chunks in ((x, [4, 12, 1]), (y, [4, 1])):
        s.add_request(r)
        assert [_step(s).num_scheduled[r.request_id] for _ in chunks] == chunks
    pool = s.kv.pool
    assert not s.has_unfinished() and len(pool.entries) == 8 and len(pool._plain) == 9
    for i in range(6):
        s.add_request(_req(f"z{i}", range(200 + 10 * i, 203 + 10 * i)))
    assert len(_step(s).num_scheduled) == 6 and pool.num_free == 2
    assert set(pool.entries) == {("ckpt", 1, x.block_hashes[3])}
