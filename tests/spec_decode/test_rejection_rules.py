"""Verification's rules, deterministic and fast (issue 44: mutmut's survivors in
``spec_decode/rejection.py`` outside the statistical tests of ``test_rejection.py``): the
target distribution after temperature, top-k, top-p and min-p against a reference written
here; min_tokens bans; greedy matching across a batch; a seeded request's draws from its own
generator only; the exponential race's proportions; the row layout and its errors."""

from __future__ import annotations

import math

import pytest
import torch

from pagefold.executor.sampler import SamplingMetadata
from pagefold.sampling_params import SAMPLING_EPS, SamplingParams
from pagefold.spec_decode.rejection import (
    expand_for_verify,
    processed_logits,
    rejection_sample,
    target_probs,
)

V = 5


pytestmark = pytest.mark.usefixtures("one_torch_thread")


LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])  # order 0 > 1 > 2 > 4 > 3


def _meta(params, outs=None, prompts=None, eos=None) -> SamplingMetadata:
    outs = outs if outs is not None else [[] for _ in params]
    return SamplingMetadata.build(list(params), outs, prompts or [[1]] * len(params),
                                  eos_token_ids=eos)


def _softmax(xs: list[float], t: float = 1.0) -> list[float]:
    e = [math.exp(x / t) if x != -math.inf else 0.0 for x in xs]
    return [v / sum(e) for v in e]


def _keep(probs: list[float], kept: set[int]) -> list[float]:
    z = sum(probs[i] for i in kept)
    return [probs[i] / z if i in kept else 0.0 for i in range(len(probs))]


@pytest.mark.parametrize("sp, want", [
    (SamplingParams(temperature=0.5), _softmax(LOGITS[0].tolist(), 0.5)),
    (SamplingParams(temperature=0.0), _softmax(LOGITS[0].tolist())),  # greedy rows: T = 1
    (SamplingParams(temperature=SAMPLING_EPS), [1.0, 0.0, 0.0, 0.0, 0.0]),
    (SamplingParams(temperature=1.0, top_k=2), _keep(_softmax(LOGITS[0].tolist()), {0, 1})),
    # mass before token 2 (sorted third) = p0 + p1 = 0.77 >= 0.75: dropped; token 1 kept
    (SamplingParams(temperature=1.0, top_p=0.75), _keep(_softmax(LOGITS[0].tolist()), {0, 1})),
    # kept where p >= 0.3 p_max: e^(x - 2) >= 0.3, x >= 2 + ln 0.3 = 0.796
    (SamplingParams(temperature=1.0, min_p=0.3), _keep(_softmax(LOGITS[0].tolist()), {0, 1})),
])
def test_target_probs_follow_the_sampling_params(sp, want):
    got = target_probs(LOGITS.clone(), _meta([sp]))[0].tolist()
    assert got == pytest.approx(want, abs=1e-6)


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    """Row 0 has generated nothing (min_tokens 2): EOS (3) and stop id 1 are banned, stop id
    5 lies just outside the vocabulary; row 1 has generated 2 tokens: nothing banned."""
    sp = SamplingParams(min_tokens=2, stop_token_ids=[1, 5])
    x = processed_logits(torch.zeros(2, V), _meta([sp, sp], [[], [0, 0]], eos=[3, 3]))
    inf = float("-inf")
    assert x.tolist() == [[0.0, inf, 0.0, inf, 0.0], [0.0] * V]


def test_greedy_drafts_are_matched_row_by_row_across_the_batch():
    """Three greedy requests, rows laid out one after another: each row's argmax is given;
    a draft is accepted while it equals the argmax of its own row."""
    drafts = [[1, 2, 3], [2, 0], [4]]
    argmax = [1, 2, 3, 4] + [2, 1, 0] + [4, 0]
    logits = torch.zeros(len(argmax), V)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 1.0
    sps = [SamplingParams(temperature=0.0)] * 3
    p_rows, o_rows = expand_for_verify(sps, [[], [], []], drafts)
    res = rejection_sample(logits, _meta(p_rows, o_rows), drafts)
    assert res.tokens == [[1, 2, 3, 4], [2, 1], [4, 0]]
    assert res.num_accepted == [3, 1, 1]
    assert res.rows == [[0, 1, 2, 3], [4, 5], [7, 8]]


def test_a_seeded_request_draws_only_from_its_own_generator():
    """Bonus and residual tokens over three tokens each: the same seed gives the same
    tokens whatever the global RNG did, and the seeds do not all agree."""
    sp = SamplingParams(temperature=1.0)
    d = [0]
    inf = float("-inf")
    # draft row: tokens 0, 2, 4 (1/3 each): accept 0, else the residual {2, 4};
    # bonus row: tokens 0, 1, 2
    logits = torch.tensor([[0.0, inf, 0.0, inf, 0.0], [0.0, 0.0, 0.0, inf, inf]])
    p_rows, o_rows = expand_for_verify([sp], [[]], [d])
    meta = _meta(p_rows, o_rows)
    seen = set()
    for seed in range(30):
        outs = []
        for global_seed in (1, 2):
            torch.manual_seed(global_seed)
            res = rejection_sample(logits, meta, [d], {0: torch.Generator().manual_seed(seed)})
            outs.append(res.tokens[0])
        assert outs[0] == outs[1]
        seen.add(tuple(outs[0]))
    assert len(seen) >= 4  # rejected -> 2 or 4; accepted -> 0 then 0, 1 or 2


def test_the_race_draws_in_proportion_to_the_weights():
    """The bonus row (no drafts) with probabilities 1/2 and 1/8 x 4: 2000 seeded draws land
    within 0.04 of each (a race on p * q instead of p / q draws the first about 62%)."""
    sp = SamplingParams(temperature=1.0)
    want = [0.5, 0.125, 0.125, 0.125, 0.125]
    logits = torch.log(torch.tensor([want]))
    meta = _meta([sp])
    counts = [0] * V
    n = 2000
    for seed in range(n):
        res = rejection_sample(logits, meta, [[]], {0: torch.Generator().manual_seed(seed)})
        counts[res.tokens[0][0]] += 1
    assert [c / n for c in counts] == pytest.approx(want, abs=0.04)


def test_rows_are_checked_one_by_one_and_expanded_per_draft():
    sp = SamplingParams(temperature=0.0)
    drafts = [[1, 2]]
    p_rows, o_rows = expand_for_verify([sp], [[5]], drafts)
    assert o_rows == [[5], [5, 1], [5, 1, 2]] and p_rows == [sp] * 3
    meta = _meta(p_rows, o_rows)
    with pytest.raises(ValueError, match="need 3 logits rows"):
        rejection_sample(torch.zeros(2, V), meta, drafts)  # logits short, metadata right
    with pytest.raises(ValueError, match="need 3 logits rows"):
        rejection_sample(torch.zeros(3, V), _meta(p_rows[:2], o_rows[:2]), drafts)
    with pytest.raises(ValueError, match="need 3 logits rows"):
        rejection_sample(torch.zeros(3, V, 1), meta, drafts)
    with pytest.raises(ValueError):
        expand_for_verify([sp], [[], []], drafts)
