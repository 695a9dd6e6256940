"""Copy-on-write of a forked request's shared partial block, on a hand-built pool with a
stand-in for the model (issue 44: mutmut's survivors in ``FullAttentionManager`` were all on
this path, which only the model-level fork tests reached).

The documented rule (``core/managers.py``): a fork shares every attention block by reference;
before a request writes into a partly filled block that another request also holds, it gets
its own copy of that one block (a ``PageCopy`` the runner executes before the forward).
Full blocks stay shared; a block written by only one holder is never copied.
"""

from __future__ import annotations

import pytest
import torch

from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_cache_planner import plan_pagefold
from pagefold.core.kv_cache_spec import FullAttentionSpec
from pagefold.core.managers import PageCopy
from pagefold.core.sched_output import SampledToken
from pagefold.core.scheduler import Scheduler
from pagefold.request import Request
from pagefold.sampling_params import SamplingParams

BS = 4
ATTN = FullAttentionSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32)


def _run(s: Scheduler, out) -> None:
    sampled = {rid: SampledToken(7) for rid, n in out.num_scheduled.items()
               if s.requests[rid].num_computed_tokens + n == s.requests[rid].num_tokens}
    s.update_from_output(out, sampled)


@pytest.mark.parametrize("used", [1, 2, 3])
def test_forked_partial_block_is_copied_once_before_it_is_written(used):
    """The prompt fills one block and ``used`` slots of the next, which the fork shares."""
    cfg = plan_pagefold({"layers.0": ATTN}, BS, 17 * ATTN.page_bytes(BS))
    s = Scheduler(KVCacheManager(cfg), max_num_batched_tokens=100, max_num_seqs=8,
                  max_model_len=100)
    s.add_request(Request("p", list(range(10, 14 + used)),
                          SamplingParams(max_tokens=8, ignore_eos=True)))
    _run(s, s.schedule())
    free = s.kv.pool.num_free
    s.fork_request("p", "c")
    (full, partial), = s.kv.block_ids("p")
    assert s.kv.block_ids("c") == [[full, partial]]  # shared, nothing taken yet
    assert s.kv.pool.num_free == free and s.kv.take_copies() == []
    out = s.schedule()  # both write the next position, inside the shared partial block
    assert out.num_scheduled == {"p": 1, "c": 1}
    (p_table,) = s.kv.block_ids("p")
    (c_table,) = s.kv.block_ids("c")
    # The parent (first in the running order) copies; the child then holds the original
    # alone and writes it in place. The full block stays shared.
    assert p_table[0] == c_table[0] == full
    assert c_table[1] == partial and p_table[1] != partial
    assert out.copies == [PageCopy(0, [partial], [p_table[1]])]
    assert s.kv.pool.num_free == free - 1
    _run(s, out)
    for _ in range(BS - 1 - used):  # the rest of the block: each owns its own, no copies
        out = s.schedule()
        assert out.copies == [] and s.kv.pool.num_free == free - 1
        _run(s, out)
    out = s.schedule()  # the next block boundary: a new block each
    assert out.copies == [] and s.kv.pool.num_free == free - 3
    _run(s, out)
    while s.has_unfinished():
        _run(s, s.schedule())
    s.kv.check_whole()


def test_fork_at_a_block_boundary_copies_nothing():
    cfg = plan_pagefold({"layers.0": ATTN}, BS, 17 * ATTN.page_bytes(BS))
    s = Scheduler(KVCacheManager(cfg), max_num_batched_tokens=100, max_num_seqs=8,
                  max_model_len=100)
    s.add_request(Request("p", list(range(10, 18)), SamplingParams(max_tokens=4,
                                                                   ignore_eos=True)))
    _run(s, s.schedule())  # 8 tokens: two full blocks
    free = s.kv.pool.num_free
    s.fork_request("p", "c")
    out = s.schedule()  # position 8 starts a fresh block for each: nothing to copy
    assert out.copies == [] and s.kv.pool.num_free == free - 2
    (p_table,) = s.kv.block_ids("p")
    (c_table,) = s.kv.block_ids("c")
    assert p_table[:2] == c_table[:2] and p_table[2] != c_table[2]
    _run(s, out)
    while s.has_unfinished():
        _run(s, s.schedule())
    s.kv.check_whole()


@pytest.mark.parametrize("spare", [0, 1])
def test_the_copy_counts_against_the_pool(spare):
    """A pool with ``spare`` free blocks after the prefill: with one, the parent's copy fits
    and nobody is preempted; with none, the child (the latest arrival) is preempted, which
    leaves the parent the block's only holder, so it writes in place and nothing is copied."""
    cfg = plan_pagefold({"layers.0": ATTN}, BS, (3 + spare) * ATTN.page_bytes(BS))
    s = Scheduler(KVCacheManager(cfg), max_num_batched_tokens=100, max_num_seqs=8,
                  max_model_len=100)
    s.add_request(Request("p", list(range(10, 16)), SamplingParams(max_tokens=2,
                                                                   ignore_eos=True)))
    _run(s, s.schedule())  # two blocks, the second holding 2 tokens
    assert s.kv.pool.num_free == spare
    s.fork_request("p", "c")
    (before,) = s.kv.block_ids("p")
    out = s.schedule()
    (after,) = s.kv.block_ids("p")
    if spare:
        assert out.preempted_ids == [] and out.num_scheduled == {"p": 1, "c": 1}
        assert out.copies == [PageCopy(0, [before[1]], [after[1]])]
    else:
        assert out.preempted_ids == ["c"] and out.num_scheduled == {"p": 1}
        assert out.copies == [] and after == before
    _run(s, out)
    while s.has_unfinished():
        _run(s, s.schedule())
    s.kv.check_whole()
