"""Forks and prefix hits under pool pressure: exact free-block counts, derived by hand (issue 44).

A hybrid model (one attention page per block of 4 tokens, a state of 2 pages) on a pool of 19
usable blocks. Every expected number below is worked out in the comments from the documented
rules (``core/managers.py``, ``core/block_pool.py``), never read back from the code:

* a cached entry nobody holds counts as free; a hit *touches* it, so it stops being free;
* a hit's attention blocks are the request's first blocks (no new block for them); a state
  hit pins the checkpoint's pages until its copy has run and gives the request its own pages;
* a fork shares attention blocks and takes a new state (2 pages) per child at once;
* admission is all-or-nothing: with one block fewer than it needs, nothing changes.
"""

from __future__ import annotations

import pytest
import torch

from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_cache_planner import plan_pagefold
from pagefold.core.kv_cache_spec import (
    FullAttentionSpec,
    SlidingWindowSpec,
    StateComponent,
    StateSpec,
)
from pagefold.core.sched_output import SampledToken
from pagefold.core.scheduler import Scheduler
from pagefold.core.swap import PreemptionCost
from pagefold.request import Request, RequestStatus
from pagefold.sampling_params import SamplingParams

BS = 4
ATTN = FullAttentionSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32)  # 128-byte page
STATE = StateSpec("gdn", (StateComponent("ssm", (64,), torch.float32),))  # two pages
USABLE = 19
A = list(range(100, 113))  # 13 tokens: three full blocks and one more


def _setup(caching: bool = True) -> Scheduler:
    cfg = plan_pagefold({"attn": ATTN, "state": STATE}, BS,
                        (USABLE + 1) * ATTN.page_bytes(BS))
    assert cfg.num_blocks == USABLE + 1 and [g.pages_per_state for g in cfg.groups] == [0, 2]
    kv = KVCacheManager(cfg, enable_prefix_caching=caching, checkpoint_interval=BS)
    return Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)


def _req(rid: str, prompt: list[int], max_tokens: int = 1, **kw) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   **kw)


def _step(s: Scheduler):
    out = s.schedule()
    sampled = {rid: SampledToken(7) for rid, n in out.num_scheduled.items()
               if s.requests[rid].num_computed_tokens + n == s.requests[rid].num_tokens}
    s.update_from_output(out, sampled)
    return out


def _serve_a(s: Scheduler) -> None:
    """A's prompt is cut at its checkpoint targets 4, 8, 12: three steps save checkpoints
    (2 pages each), the fourth computes token 12 and samples its one token."""
    s.add_request(_req("a", A))
    while s.has_unfinished():
        _step(s)
    pool = s.kv.pool
    # Cached and free: 3 attention blocks and 3 checkpoints (6 pages); the rest plain.
    assert pool.num_free == USABLE
    assert pool.checkpoint_stats() == (3, 6) and len(pool.entries) == 3 + 3


@pytest.mark.parametrize("spare", [0, 1])
def test_a_hit_on_free_entries_costs_what_it_touches(spare):
    """b shares A's first two blocks. Its hit (8 tokens) costs: the 2 cached attention blocks
    it touches (they stop being free), 2 new attention blocks for tokens 8..12, the
    checkpoint at 8 pinned until its copy (2 pages) and b's own state (2 pages): 8."""
    s = _setup()
    _serve_a(s)
    kv, pool = s.kv, s.kv.pool
    b = _req("b", A[:8] + [200, 201, 202, 203, 204])
    assert kv.find_hit(b) == 2
    assert kv.blocks_needed(b, 5, hit_blocks=2) == 8
    # Leave exactly 7 + spare free: holding 10 plain blocks and 2 more evicts the lowest
    # scoring entry (the checkpoint at 4: fewest tokens saved per page) for 1 of them.
    filler = pool.allocate(USABLE - 7 - spare)
    assert pool.checkpoint_stats() == (2, 4) and pool.num_free == 7 + spare
    assert kv.find_hit(b) == 2
    if not spare:
        assert not kv.allocate_slots(b, 5, hit_blocks=2)
        assert pool.num_free == 7 and kv.block_ids("b") == [[], []]
        assert b.num_computed_tokens == 0 and pool.entry(("ckpt", 1, b.block_hashes[1])) \
            .num_hits == 0
        pool.free(filler)
        return
    assert kv.allocate_slots(b, 5, hit_blocks=2)
    assert pool.num_free == 0 and b.num_computed_tokens == 8
    attn, state = kv.block_ids("b")
    assert attn[:2] == [pool.lookup((0, h)).block_id for h in b.block_hashes[:2]]
    ckpt = pool.entry(("ckpt", 1, b.block_hashes[1]))
    assert ckpt.num_hits == 1 and pool.stats.checkpoint_hits == 1
    (copy,) = kv.take_copies()  # the restore: the checkpoint at 8 into b's own pages
    assert copy.src == [p.block_id for p in ckpt.blocks] and copy.dst == state
    assert all(p.ref_cnt == 1 for p in ckpt.blocks)  # pinned by the copy only
    kv.release_pins()  # the step ran: the checkpoint is free (cached) again
    assert pool.num_free == 2 and ckpt.evictable
    kv.free(b)
    pool.free(filler)
    # b's two uncached blocks and its state are plain; its hit blocks are cached again.
    assert pool.num_free == USABLE


def test_a_hit_on_entries_a_running_request_holds_costs_no_extra_block():
    """c shares all of A's 12 full tokens while A is still decoding: A holds those attention
    blocks and its newest checkpoint (at 12), so the hit touches nothing free. c needs one
    new attention block (tokens 12..14) and its state: 3."""
    s = _setup()
    s.add_request(_req("a", A, max_tokens=4))
    for _ in range(4):  # 4, 8, 12, then token 12 and the first sample
        _step(s)
    kv, pool = s.kv, s.kv.pool
    # A holds 4 attention blocks, its state (2), its own checkpoint at 12 (2); the cached,
    # free ones: the checkpoints at 4 and 8 (4 pages).
    assert pool.num_free == USABLE - 8
    c = _req("c", A[:12] + [300, 301])
    assert kv.find_hit(c) == 3
    assert kv.blocks_needed(c, 2, hit_blocks=3) == 3
    assert kv.allocate_slots(c, 2, hit_blocks=3)
    assert pool.num_free == USABLE - 8 - 3
    assert kv.block_ids("c")[0][:3] == kv.block_ids("a")[0][:3]
    assert [pool.blocks[b].ref_cnt for b in kv.block_ids("c")[0][:3]] == [2, 2, 2]
    kv.take_copies()
    kv.release_pins()
    assert pool.num_free == USABLE - 8 - 3  # the pinned checkpoint is still A's own
    kv.free(c)
    assert pool.num_free == USABLE - 8


@pytest.mark.parametrize("children", [1, 2, 3])
def test_fork_takes_one_state_per_child_and_no_attention_block(children):
    """A running parent with exactly 4 free blocks: two children fit (a state each), a
    third does not; each child shares the parent's 4 attention blocks."""
    s = _setup(caching=False)
    s.add_request(_req("p", A, max_tokens=8))
    _step(s)  # 13 tokens: 4 attention blocks and the state
    kv, pool = s.kv, s.kv.pool
    assert pool.num_free == USABLE - 6
    held = pool.allocate(USABLE - 6 - 4)
    p = s.requests["p"]
    assert kv.can_fork(p, children) == (children <= 2)
    if children > 2:
        with pytest.raises(RuntimeError, match="no free blocks to fork"):
            for i in range(children):
                s.fork_request("p", f"c{i}")
        assert pool.num_free == 0  # the two that fitted took their states
    else:
        for i in range(children):
            s.fork_request("p", f"c{i}")
        assert pool.num_free == 4 - 2 * children
        for i in range(children):
            assert kv.block_ids(f"c{i}")[0] == kv.block_ids("p")[0]
    assert [pool.blocks[b].ref_cnt for b in kv.block_ids("p")[0]] == [1 + min(children, 2)] * 4
    pool.free(held)


def test_an_attention_only_fork_costs_nothing():
    cfg = plan_pagefold({"attn": ATTN}, BS, 5 * ATTN.page_bytes(BS))
    kv = KVCacheManager(cfg)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    s.add_request(_req("p", list(range(16)), max_tokens=4))
    _step(s)
    assert kv.pool.num_free == 0
    assert kv.can_fork(s.requests["p"], 5)
    s.fork_request("p", "c")
    assert kv.pool.num_free == 0 and kv.block_ids("c") == kv.block_ids("p")


def _captured(usable: int) -> Scheduler:
    cfg = plan_pagefold({"attn": ATTN, "state": STATE}, BS, (usable + 1) * ATTN.page_bytes(BS))
    kv = KVCacheManager(cfg, enable_prefix_caching=True, checkpoint_interval=BS,
                        capture_in_kernel=True)
    return Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)


@pytest.mark.parametrize("usable", [12, 11])
def test_captures_take_the_last_free_pages(usable):
    """A's 13 tokens in one step take 4 attention blocks and its state (6); the checkpoints
    at 4, 8 and 12 are captured inside the step, 2 pages each, while 2 pages are free: with
    12 usable blocks all three (the last one takes the last 2 pages), with 11 only two."""
    s = _captured(usable)
    s.add_request(_req("a", A))
    out = s.schedule()
    want = [4, 8, 12] if usable == 12 else [4, 8]
    assert [c.num_tokens for c in out.captures] == want
    assert s.kv.pool.num_free == usable - 6 - 2 * len(want)
    _finish_step(s, out)
    assert s.kv.pool.checkpoint_stats() == (len(want), 2 * len(want))


def test_a_request_aborted_during_its_step_returns_its_capture_pages():
    """Aborted between ``schedule`` and ``update_from_output`` (the API's abort while a
    step runs): its planned captures are never registered, and every page comes back."""
    s = _captured(USABLE)
    s.add_request(_req("a", A, max_tokens=4))
    out = s.schedule()
    assert len(out.captures) == 3 and s.kv.pool.num_free == USABLE - 6 - 6
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert s.kv.pool.num_free == USABLE
    _finish_step(s, out)
    assert s.kv.pool.checkpoint_stats() == (0, 0) and s.kv.pool.num_free == USABLE
    s.kv.check_whole()


def _finish_step(s: Scheduler, out) -> None:
    sampled = {rid: SampledToken(7) for rid, n in out.num_scheduled.items()
               if rid in s.requests
               and s.requests[rid].num_computed_tokens + n == s.requests[rid].num_tokens}
    s.update_from_output(out, sampled)


def test_a_hit_shorter_than_the_cached_chain_costs_only_its_blocks():
    """b's prompt is A's first 12 tokens: all 3 blocks are cached, but the hit stops at 2
    (the last token is computed). It costs 2 attention blocks, the checkpoint at 8 (2), one
    new attention block and its state (2): 7, exactly what is left free."""
    s = _setup()
    _serve_a(s)
    kv, pool = s.kv, s.kv.pool
    filler = pool.allocate(USABLE - 7)  # evicts the checkpoint at 4 (as above)
    assert pool.num_free == 7
    b = _req("b", A[:12])
    assert kv.find_hit(b) == 2
    assert kv.blocks_needed(b, 4, hit_blocks=2) == 7
    assert kv.allocate_slots(b, 4, hit_blocks=2)
    assert pool.num_free == 0
    kv.take_copies()
    kv.release_pins()
    kv.free(b)
    pool.free(filler)


@pytest.mark.parametrize("usable", [8, 7])
def test_a_checkpoint_is_saved_with_exactly_its_pages_free(usable):
    """An 8-token prompt cut at 4: after the first chunk A holds 1 attention block, its state
    and its checkpoint at 4 (5); the second takes 1 more block. With 8 usable blocks the 2
    left hold the checkpoint at 8; with 7, one page is left and it is skipped."""
    cfg = plan_pagefold({"attn": ATTN, "state": STATE}, BS, (usable + 1) * ATTN.page_bytes(BS))
    kv = KVCacheManager(cfg, enable_prefix_caching=True, checkpoint_interval=BS)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    s.add_request(_req("a", A[:8]))
    assert _step(s).num_scheduled == {"a": 4}
    assert kv.pool.num_free == usable - 5
    assert _step(s).num_scheduled == {"a": 4}
    want = 2 if usable == 8 else 1
    assert kv.pool.checkpoint_stats() == (want, 2 * want)
    while s.has_unfinished():
        _step(s)
    kv.check_whole()


def test_two_state_groups_keep_their_checkpoints_through_a_tight_hit():
    """Two state groups ahead of the attention group. a (5 tokens) leaves a checkpoint at 4
    in each state group; c, later, the same for another prompt. b shares a's first block
    and finds only cached entries free (10 blocks: its hit's 5 and c's 5). The first state
    group's pages for b must evict c's entries, never the second group's checkpoint that
    b's own hit is about to restore (the oldest, lowest-scoring entry left)."""
    specs = {"s0": STATE, "s1": STATE, "attn": ATTN}
    cfg = plan_pagefold(specs, BS, 30 * ATTN.page_bytes(BS))
    kv = KVCacheManager(cfg, enable_prefix_caching=True, checkpoint_interval=BS)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    pool = kv.pool
    for rid, prompt in (("a", A[:5]), ("c", [50, 51, 52, 53, 54])):
        s.add_request(_req(rid, prompt))
        while s.has_unfinished():
            _step(s)
    assert pool.checkpoint_stats() == (4, 8) and len(pool.entries) == 6
    filler = pool.allocate(pool.num_free - 10)
    assert pool.num_free == 10
    b = _req("b", A[:4] + [60, 61])
    assert kv.find_hit(b) == 1
    want_src = [[p.block_id for p in pool.entry(("ckpt", g, b.block_hashes[0])).blocks]
                for g in (0, 1)]
    assert kv.blocks_needed(b, 2, hit_blocks=1) == 10
    assert kv.allocate_slots(b, 2, hit_blocks=1)
    copies = kv.take_copies()
    assert [c.src for c in copies] == want_src
    assert [c.dst for c in copies] == [kv.block_ids("b")[0], kv.block_ids("b")[1]]
    assert pool.num_free == 0
    kv.release_pins()
    kv.free(b)
    pool.free(filler)


def test_a_dead_window_block_shared_with_a_fork_frees_nothing():
    """Sliding window of 6, blocks of 4. The parent computed 12 tokens (3 blocks) and forks.
    Position 12 reads keys 7..12, so block 0 is dead, but the child still holds it: the
    parent's next token costs its new block, and nothing comes back."""
    swa = SlidingWindowSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32, window=6)
    cfg = plan_pagefold({"swa": swa}, BS, 10 * swa.page_bytes(BS))
    kv = KVCacheManager(cfg)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    s.add_request(_req("p", list(range(12)), max_tokens=4))
    _step(s)
    assert kv.pool.num_free == 9 - 3
    s.fork_request("p", "c")
    p = s.requests["p"]
    assert kv.blocks_needed(p, 1) == 1
    out = _step(s)
    assert out.num_scheduled == {"p": 1, "c": 1}
    # Each took a block for position 12; block 0 went to the null block in both tables,
    # and back to the pool only once both let go of it.
    assert kv.pool.num_free == 9 - 3 - 2 + 1


def test_a_family_forks_every_child_that_fits():
    """Two children and room for both: both continue from the parent's cache at once
    (running, with the parent's computed tokens), each with its own state."""
    s = _setup(caching=False)
    s.add_request(_req("p", A, max_tokens=4, fork_children=2, fork_at=len(A) - 1,
                       arrival_time=0.0))
    s.add_request(_req("q", [1, 2, 3], max_tokens=4, arrival_time=1.0))
    _step(s)  # the shared prefill stops at fork_at; q prefills and samples
    p = s.requests["p"]
    assert p.num_computed_tokens == len(A) - 1
    free = s.kv.pool.num_free
    out = _step(s)  # forks first, then all three compute the last prompt token
    kids = [r for r in s.requests.values() if r.parent_id == "p"]
    assert len(kids) == 2 and s.num_forks == 2
    assert all(k.status == RequestStatus.RUNNING for k in kids)
    # The children run right after their parent, ahead of q (q decodes inside its block).
    order = [r.request_id for r in s.running]
    assert order[0] == "p" and sorted(order[1:3]) == sorted(k.request_id for k in kids)
    assert order[3] == "q"
    assert out.num_scheduled == {"p": 1, order[1]: 1, order[2]: 1, "q": 1}
    assert list(out.num_scheduled) == order  # the layout follows the running order
    assert sorted(r.req_id for r in out.new_reqs) == sorted(k.request_id for k in kids)
    assert all(r.num_computed_tokens == 12 for r in out.new_reqs)
    # a state each (2 x 2 pages), and position 12 opens block 3: a new block each (3)
    assert s.kv.pool.num_free == free - 2 * 2 - 3


def test_a_preempted_request_gives_back_its_share_of_the_step():
    """Priority scheduling: L (low priority) is scheduled first in the running order, then H
    needs a block the full pool does not have, so L is preempted. The token L had been
    given goes back to the step's budget of 2, so N (decoding inside its block) still runs."""
    cfg = plan_pagefold({"attn": ATTN}, BS, 5 * ATTN.page_bytes(BS))  # 4 usable blocks
    s = Scheduler(KVCacheManager(cfg), max_num_batched_tokens=64, max_num_seqs=8,
                  max_model_len=64, policy="priority")
    s.add_request(_req("L", [1, 2, 3, 4], max_tokens=8, arrival_time=0.0, priority=9))
    _step(s)  # L: one block, 5 tokens now
    s.add_request(_req("H", [5, 6, 7, 8], max_tokens=8, arrival_time=1.0))
    s.add_request(_req("N", [9, 10], max_tokens=8, arrival_time=2.0))
    out = _step(s)  # L opens its second block; H and N one block each: the pool is full
    assert out.num_scheduled == {"L": 1, "H": 4, "N": 2} and s.kv.pool.num_free == 0
    s.max_num_batched_tokens = 2
    out = _step(s)
    assert out.preempted_ids == ["L"]
    assert out.num_scheduled == {"H": 1, "N": 1}


def _swapping(host_rows: int) -> Scheduler:
    s = _setup()
    s.kv.attach_swap(host_rows, "swap", PreemptionCost(flops_per_token=1.0))
    return s


def test_swap_or_recompute_with_copies_queued():
    """Swap mode, 6 host rows. After one step of a and b (8-token prompts cut at 4) the
    checkpoint saves of both are queued: they write checkpoint pages, not a's or b's. a is
    swapped out (its 3 pages: one attention block and its state). A child c forked from b has
    its state copy queued *into* its own pages: recomputed, though its 3 pages would fit the 3
    rows left. b then takes exactly those 3 rows."""
    s = _swapping(6)
    for i, rid in enumerate("ab"):
        s.add_request(_req(rid, [50 * i + j for j in range(8)], max_tokens=4,
                           arrival_time=float(i)))
    assert _step(s).num_scheduled == {"a": 4, "b": 4}
    kv = s.kv
    assert kv.has_pending_copies
    page = ATTN.page_bytes(BS)
    assert kv.preempt(s.requests["a"]) == "swap"
    assert (kv.swap_stats.swaps_out, kv.swap_stats.bytes_out) == (1, 3 * page)
    assert kv.host.num_free == 3
    s.fork_request("b", "c")
    assert sum(map(len, kv.block_ids("c"))) == 3
    assert kv.preempt(s.requests["c"]) == "recompute"
    assert kv.preempt(s.requests["b"]) == "swap" and kv.host.num_free == 0
    assert (kv.swap_stats.swaps_out, kv.swap_stats.bytes_out) == (2, 6 * page)
    # a, aborted while parked on the host, gives its rows back.
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert kv.host.num_free == 3 and "a" not in kv.swapped


def test_a_swapped_request_comes_back_whole():
    s = _swapping(16)
    s.add_request(_req("a", A[:8], max_tokens=4))
    _step(s)
    kv, a = s.kv, s.requests["a"]
    s._preempt(a)
    assert kv.swap_stats.swaps_out == 1
    out = s.schedule()
    assert [r.req_id for r in out.new_reqs] == ["a"] and out.new_reqs[0].num_computed_tokens == 4
    page = ATTN.page_bytes(BS)
    assert (kv.swap_stats.swaps_in, kv.swap_stats.bytes_in) == (1, 3 * page)
    # The swap-outs (queued by the preemption) and the swap-ins, per group, in that order.
    assert [(op.to_host, op.group) for op in out.swaps] == [(True, 0), (True, 1), (False, 0),
                                                           (False, 1)]
