"""Where a preempted request resumes (issue 44): swap keeps every computed token, recompute
starts over, recompute with prefix caching starts at the cached prefix it gets back. Asserted
on the step that re-admits it (its ``NewRequestData.num_computed_tokens`` and the tokens it is
scheduled), not only through the final tokens."""

from __future__ import annotations

import pytest
import torch

from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_cache_planner import plan_pagefold
from pagefold.core.kv_cache_spec import FullAttentionSpec, StateComponent, StateSpec
from pagefold.core.sched_output import SampledToken
from pagefold.core.scheduler import Scheduler
from pagefold.core.swap import PreemptionCost
from pagefold.request import Request
from pagefold.sampling_params import SamplingParams

BS = 4
ATTN = FullAttentionSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32)


def _setup(mode: str, caching: bool) -> Scheduler:
    cfg = plan_pagefold({"layers.0": ATTN}, BS, 7 * ATTN.page_bytes(BS))  # 6 usable blocks
    kv = KVCacheManager(cfg, enable_prefix_caching=caching)
    if mode == "swap":
        kv.attach_swap(16, "swap", PreemptionCost(flops_per_token=1.0))
    s = Scheduler(kv, max_num_batched_tokens=100, max_num_seqs=8, max_model_len=200)
    # Two blocks each fill the pool; a needs its third block on step 2, before b, so c (the
    # latest arrival) is preempted with 7 computed tokens: one full block, one partial. a ends
    # on that step, so c comes back on the next one, its cached block still there.
    for i, (rid, n, m) in enumerate([("a", 8, 2), ("b", 5, 8), ("c", 7, 8)]):
        ids = [100 * i + j for j in range(n)]
        s.add_request(Request(rid, ids, SamplingParams(max_tokens=m, ignore_eos=True),
                              arrival_time=float(i)))
    return s


def _finish(s: Scheduler, out) -> None:
    sampled = {rid: SampledToken(7) for rid, n in out.num_scheduled.items()
               if s.requests[rid].num_computed_tokens + n == s.requests[rid].num_tokens}
    s.update_from_output(out, sampled)


def _step(s: Scheduler):
    out = s.schedule()
    _finish(s, out)
    return out


@pytest.mark.parametrize("mode,caching", [("swap", False), ("recompute", False),
                                          ("recompute", True)])
def test_preempted_request_resumes_where_it_should(mode, caching):
    s = _setup(mode, caching)
    c = s.requests["c"]
    computed = None
    for _ in range(40):
        before = c.num_computed_tokens
        out = _step(s)
        if "c" in out.preempted_ids:
            computed = before
            break
    assert computed == 7
    assert s.kv.preempt_log.decisions[-1][1] == mode
    # c is the one preemption so far, counted once, by kind and on the request.
    assert (s.num_preemptions, s.preemptions_by_kind, c.num_preemptions) == (1, {mode: 1}, 1)
    credit = s.kv.preempt_log.credited_tokens
    # swap: everything stays computed; recompute: nothing; with the prefix cache: c's one
    # full block (its partial block is never cached), which nothing evicted meanwhile.
    want = {("swap", False): 7, ("recompute", False): 0, ("recompute", True): BS}[mode, caching]
    out = s.schedule()  # a ended on the step that preempted c: c is back at once
    assert [r.req_id for r in out.new_reqs] == ["c"]
    (back,) = out.new_reqs
    assert back.num_computed_tokens == want
    assert c.num_cached_tokens == 0  # what its *first* scheduling found in the cache
    # It is scheduled from there to its end: its tokens are the prompt and 1 sampled token.
    assert c.num_output_tokens == 1
    assert out.num_scheduled["c"] == 8 - want
    assert bool(out.swaps) == (mode == "swap")
    if caching:
        assert credit == want and s.kv.stats.hits == want
    _finish(s, out)
    while s.has_unfinished():
        _step(s)
    assert c.num_output_tokens == 8
    s.kv.check_whole()


def test_a_fully_cached_prompt_still_computes_its_last_block():
    """A prompt whose every block is cached (another request computed it and more) resumes
    one block short: the last prompt token must be computed to sample from it."""
    cfg = plan_pagefold({"layers.0": ATTN}, BS, 21 * ATTN.page_bytes(BS))
    s = Scheduler(KVCacheManager(cfg, enable_prefix_caching=True), max_num_batched_tokens=100,
                  max_num_seqs=8, max_model_len=200)
    prompt = list(range(8))  # two full blocks
    for rid in ("first", "again"):
        s.add_request(Request(rid, prompt, SamplingParams(max_tokens=3, ignore_eos=True)))
        out = s.schedule()
        assert [r.req_id for r in out.new_reqs] == [rid]  # scheduled, with tokens to compute
        (new,) = out.new_reqs
        if rid == "again":  # both blocks are cached now; the hit stops one block short
            assert new.num_computed_tokens == BS and out.num_scheduled[rid] == 8 - BS
        _finish(s, out)
        while s.has_unfinished():
            _step(s)
    assert s.kv.stats.hits == BS
    s.kv.check_whole()


def test_recompute_resumes_at_the_state_checkpoint_not_the_attention_prefix():
    """A hybrid (attention + a one-page state), prefix caching, checkpoints every 4 tokens:
    c (10 prompt tokens) is preempted with 8 computed. Its attention blocks cover 8 tokens,
    but its state was saved only at 4 (at 8 the pool had no free page for the copy), so it
    resumes at 4: the longest prefix that *every* group can serve."""
    state = StateSpec("gdn", (StateComponent("ssm", (8,), torch.float32),))
    cfg = plan_pagefold({"attn": ATTN, "state": state}, BS, 13 * ATTN.page_bytes(BS))
    kv = KVCacheManager(cfg, enable_prefix_caching=True, checkpoint_interval=BS)
    s = Scheduler(kv, max_num_batched_tokens=100, max_num_seqs=8, max_model_len=200)
    for i, (rid, n, m) in enumerate([("a", 8, 3), ("b", 5, 8), ("c", 10, 8)]):
        s.add_request(Request(rid, [100 * i + j for j in range(n)],
                              SamplingParams(max_tokens=m, ignore_eos=True),
                              arrival_time=float(i)))
    c = s.requests["c"]
    _step(s)  # prompts cut at their checkpoint targets: 4 tokens each
    out = s.schedule()
    assert out.num_scheduled["c"] == 4 and kv.pool.num_free == 0  # no page for c's copy at 8
    _finish(s, out)
    out = s.schedule()
    assert out.preempted_ids == ["c"] and c.num_computed_tokens == 0
    attention_hit = kv.managers[0].hit_lengths(c.block_hashes, 2)
    assert attention_hit == 2 and kv.preempt_log.credited_tokens == BS
    _finish(s, out)
    while True:
        out = s.schedule()
        if out.new_reqs:
            break
        _finish(s, out)
    assert [r.req_id for r in out.new_reqs] == ["c"]
    assert out.new_reqs[0].num_computed_tokens == BS
    _finish(s, out)
    while s.has_unfinished():
        _step(s)
    assert c.num_output_tokens == 8
    s.kv.check_whole()
