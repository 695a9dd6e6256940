"""A speculative step's result in the scheduler, without a model (issue 44: mutmut's survivors
in ``Scheduler._append_verified`` were reached only by the model-level speculative tests).

The documented rule (``core/scheduler.py``, ``spec_decode/engine.py``): a decoding request
scheduled for ``1 + k`` tokens (its last token and ``k`` drafts) advances by ``1 + accepted``
computed tokens; the accepted drafts and the sampled token are appended one by one through
the stop rules, each with its logprobs; a stop before the last emitted token drops the rest.
"""

from __future__ import annotations

import pytest
import torch

from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_cache_planner import plan_pagefold
from pagefold.core.kv_cache_spec import FullAttentionSpec
from pagefold.core.sched_output import SampledToken, VerifiedTokens
from pagefold.core.scheduler import Scheduler
from pagefold.request import Request, RequestStatus
from pagefold.sampling_params import SamplingParams

BS = 4
ATTN = FullAttentionSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32)
EOS = 99


def _decoding(max_tokens: int = 10, caching: bool = False, **sp) -> tuple[Scheduler, Request]:
    """A request with a 5-token prompt that has sampled its first token (6 tokens, 5
    computed)."""
    kv = KVCacheManager(plan_pagefold({"a": ATTN}, BS, 33 * ATTN.page_bytes(BS)),
                        enable_prefix_caching=caching)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64)
    r = Request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=max_tokens, logprobs=0, **sp),
                eos_token_id=EOS)
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, {"r": SampledToken(6, ([6], [-0.5], 1))})
    assert (r.num_tokens, r.num_computed_tokens) == (6, 5)
    return s, r


def _lp(t: int, v: float):
    return ([t], [v], 1)


def test_accepted_drafts_and_the_sampled_token_are_appended():
    s, r = _decoding()
    s.spec_token_ids = {"r": [7, 8, 9]}
    out = s.schedule()
    assert out.num_scheduled == {"r": 4} and out.spec_token_ids == {"r": [7, 8, 9]}
    res = VerifiedTokens([7, 20], 1, [_lp(7, -1.0), _lp(20, -2.0)])
    (eo,) = s.update_from_output(out, {"r": res})
    # 4 computed this step, 2 of them rejected drafts: 5 + 1 + 1 computed.
    assert r.num_computed_tokens == 7 and r.output_token_ids == [6, 7, 20]
    assert r.num_tokens == 8  # the sampled token (20) is not computed yet
    assert eo.new_token_ids == [7, 20] and eo.finish_reason is None
    assert eo.num_cached_tokens == 0
    assert eo.new_logprobs == [_lp(7, -1.0), _lp(20, -2.0)]
    assert r.cumulative_logprob == pytest.approx(-0.5 - 1.0 - 2.0)
    # The next step computes just the sampled token (no drafts offered).
    s.spec_token_ids = {}
    out = s.schedule()
    assert out.num_scheduled == {"r": 1}
    assert out.cached_reqs[0].num_computed_tokens == 7
    assert out.cached_reqs[0].new_token_ids == [20]


def test_all_drafts_accepted():
    s, r = _decoding()
    s.spec_token_ids = {"r": [7, 8]}
    out = s.schedule()
    (eo,) = s.update_from_output(out, {"r": VerifiedTokens([7, 8, 21], 2)})
    assert r.num_computed_tokens == 8 and r.output_token_ids == [6, 7, 8, 21]
    assert eo.new_token_ids == [7, 8, 21] and eo.new_logprobs == []


@pytest.mark.parametrize("where", ["eos", "max_tokens", "stop_id"])
def test_a_stop_inside_the_accepted_tokens_drops_the_rest(where):
    """The second emitted token stops the request (EOS, max_tokens 3 reached, or a stop
    token): the third is not appended, the request finishes on this step and its blocks go
    back."""
    s, r = _decoding(max_tokens=3 if where == "max_tokens" else 10,
                     **({"stop_token_ids": [8]} if where == "stop_id" else {}))
    s.spec_token_ids = {"r": [7, 8, 9]}
    out = s.schedule()
    stop = EOS if where == "eos" else 8
    if where == "stop_id":
        where = "eos"  # the same finish; the stop token is reported as the reason
    res = VerifiedTokens([7, stop, 22], 2, [_lp(7, -1.0), _lp(stop, -1.5), _lp(22, -3.0)])
    (eo,) = s.update_from_output(out, {"r": res})
    assert r.output_token_ids == [6, 7, stop]
    assert eo.new_token_ids == [7, stop]
    assert eo.new_logprobs == [_lp(7, -1.0), _lp(stop, -1.5)]
    assert r.cumulative_logprob == pytest.approx(-0.5 - 1.0 - 1.5)
    assert eo.finish_reason == ("stop" if where == "eos" else "length")
    assert eo.stop_reason == (8 if r.sampling_params.stop_token_ids else None)
    assert r.status == (RequestStatus.FINISHED_STOPPED if where == "eos"
                        else RequestStatus.FINISHED_LENGTH)
    assert "r" not in s.requests and s.kv.pool.num_free == s.kv.pool.num_usable


def test_a_stop_on_the_last_emitted_token():
    s, r = _decoding()
    s.spec_token_ids = {"r": [7, 8]}
    out = s.schedule()
    (eo,) = s.update_from_output(out, {"r": VerifiedTokens([7, EOS], 1)})
    assert r.output_token_ids == [6, 7, EOS] and eo.finish_reason == "stop"
    assert "r" not in s.requests
    s.kv.check_whole()


def test_the_verified_output_names_its_request_and_family():
    s, r = _decoding()
    r.parent_id, r.index, r.num_cached_tokens = "fam", 2, 4
    s.spec_token_ids = {"r": [7]}
    out = s.schedule()
    assert out.num_scheduled == {"r": 2} and out.spec_token_ids == {"r": [7]}
    (eo,) = s.update_from_output(out, {"r": VerifiedTokens([7, 8], 1)})
    assert (eo.request_id, eo.parent_id, eo.index, eo.num_cached_tokens) == ("r", "fam", 2, 4)


def test_a_sampled_tokens_output_fields():
    """One plain step's output: the request, its family, its cached prompt tokens, the
    first-scheduled time and prompt logprobs on its first token only, logprobs summed."""
    s = Scheduler(KVCacheManager(plan_pagefold({"a": ATTN}, BS, 33 * ATTN.page_bytes(BS))),
                  max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64)
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=2, logprobs=0), parent_id="fam",
                index=1)
    s.add_request(r)
    out = s.schedule()
    plp = [([2], [-0.25], 1), ([3], [-0.75], 1)]
    (eo,) = s.update_from_output(out, {"r": SampledToken(5, _lp(5, -0.5), plp)})
    assert (eo.request_id, eo.parent_id, eo.index, eo.num_cached_tokens) == ("r", "fam", 1, 0)
    assert eo.new_token_ids == [5] and eo.new_logprobs == [_lp(5, -0.5)]
    assert eo.prompt_logprobs == plp
    assert eo.scheduled_time == r.first_scheduled_time and eo.scheduled_time is not None
    out = s.schedule()
    (eo,) = s.update_from_output(out, {"r": SampledToken(6, _lp(6, -1.0))})
    assert eo.scheduled_time is None and eo.prompt_logprobs is None
    assert eo.finish_reason == "length" and r.cumulative_logprob == pytest.approx(-1.5)


@pytest.mark.parametrize("budget,sent", [(3, [7, 8]), (1, None)])
def test_a_step_budget_cuts_the_drafts(budget, sent):
    """Three drafts but a budget of 3 tokens: the request's last token and 2 drafts; with a
    budget of 1, a plain decode step that carries no drafts."""
    s, r = _decoding()
    s.max_num_batched_tokens = budget
    s.spec_token_ids = {"r": [7, 8, 9]}
    out = s.schedule()
    assert out.num_scheduled == {"r": budget}
    assert out.spec_token_ids == ({"r": sent} if sent else {})


def test_a_verify_step_caches_the_blocks_it_completed():
    """With prefix caching, a verify step whose accepted tokens complete block 1 (positions
    4..7) caches it, like plain decode steps would."""
    s, r = _decoding(caching=True)
    s.spec_token_ids = {"r": [7, 8]}
    out = s.schedule()  # positions 5, 6, 7
    s.update_from_output(out, {"r": VerifiedTokens([7, 8, 21], 2)})
    assert r.num_computed_tokens == 8
    assert [s.kv.pool.lookup((0, h)) is not None for h in r.block_hashes[:2]] == [True, True]


def test_a_verify_step_that_stops_on_its_last_token_still_caches_its_blocks():
    """A stop on the last emitted token leaves the computed length at the step's end, so
    the block it completed (positions 4..7) is cached as after any step; only a stop
    *before* the last emitted token caches nothing of the step."""
    s, r = _decoding(caching=True)
    s.spec_token_ids = {"r": [7, 8]}
    out = s.schedule()  # positions 5, 6, 7
    s.update_from_output(out, {"r": VerifiedTokens([7, 8, EOS], 2)})
    assert r.output_token_ids == [6, 7, 8, EOS] and "r" not in s.requests
    assert [s.kv.pool.lookup((0, h)) is not None for h in r.block_hashes[:2]] == [True, True]


def test_replacing_a_token_needs_an_uncomputed_sampled_one():
    s = Scheduler(KVCacheManager(plan_pagefold({"a": ATTN}, BS, 33 * ATTN.page_bytes(BS))),
                  max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64)
    s.add_request(Request("r", [1, 2, 3], SamplingParams(max_tokens=4)))
    with pytest.raises(ValueError) as e:
        s.replace_last_token("r", 9)
    assert str(e.value) == "request 'r' has no uncomputed sampled token"
