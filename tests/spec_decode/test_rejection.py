"""Verification: greedy equals plain greedy; rejection sampling keeps the target distribution.

The statistical tests compare the empirical distribution of the first three generated tokens
(with speculation: drafts from the n-gram proposer, from a fixed deterministic guesser, or
sampled from a draft distribution) against the *exact* distribution of plain sampling, computed
by enumerating all continuations through the same processing (penalties, temperature, top-k).
A chi-square goodness-of-fit test at p > 1e-4 over thousands of seeds; a mutant that accepts a
draft too often (or resamples from p instead of the residual) fails it by orders of magnitude.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from pagefold.executor.sampler import SamplingMetadata
from pagefold.sampling_params import SamplingParams
from pagefold.spec_decode.ngram import ngram_propose
from pagefold.spec_decode.rejection import (
    expand_for_verify,
    processed_logits,
    rejection_sample,
    target_probs,
)

V = 5


pytestmark = pytest.mark.usefixtures("one_torch_thread")

TABLE = torch.randn(V * V, V, generator=torch.Generator().manual_seed(3)) * 1.5
DRAFT_TABLE = torch.randn(V * V, V, generator=torch.Generator().manual_seed(4))
PROMPT = [1, 2, 3, 1, 2, 4, 1, 2]


def _chi2_sf(stat: float, df: int) -> float:
    """Upper tail of the chi-square distribution (regularised upper incomplete gamma)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def _logits(ctx: list[int]) -> torch.Tensor:
    return TABLE[ctx[-2] * V + ctx[-1]]


def _meta(params: list[SamplingParams], outs: list[list[int]]) -> SamplingMetadata:
    return SamplingMetadata.build(params, outs, [PROMPT] * len(params), eos_token_ids=None)


def _exact(sp: SamplingParams, n: int) -> dict[tuple[int, ...], float]:
    dist = {}
    for seq in itertools.product(range(V), repeat=n):
        pr = 1.0
        for j in range(n):
            out = list(seq[:j])
            meta = _meta([sp], [out])
            x = processed_logits(_logits(PROMPT + out).unsqueeze(0), meta)
            pr *= float(target_probs(x, meta)[0, seq[j]])
        dist[seq] = pr
    return dist


def _generate_spec(sp: SamplingParams, n: int, seed: int, drafter: str, k: int = 3
                   ) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while len(out) < n:
        ctx = PROMPT + out
        qs = None
        if drafter == "ngram":
            d = ngram_propose(np.array(ctx), k, 1, 3).tolist()
        elif drafter == "guess":
            d = [(ctx[-1] + 1 + j) % V for j in range(k)]
        else:  # a draft distribution: sample drafts from q, pass q along
            d, q_rows, c = [], [], list(ctx)
            for _ in range(k):
                q = DRAFT_TABLE[c[-2] * V + c[-1]].softmax(0)
                t = int(torch.multinomial(q, 1, generator=gen))
                d.append(t)
                q_rows.append(q)
                c.append(t)
            qs = [torch.stack(q_rows)]
        p_rows, o_rows = expand_for_verify([sp], [out], [d])
        logits = torch.stack([_logits(ctx + d[:j]) for j in range(len(d) + 1)])
        res = rejection_sample(logits, _meta(p_rows, o_rows), [d], {0: gen}, qs)
        assert len(res.tokens[0]) == res.num_accepted[0] + 1
        out += res.tokens[0]
    return tuple(out[:n])


@pytest.mark.slow
@pytest.mark.parametrize("sp, drafter", [
    (SamplingParams(temperature=1.0), "ngram"),
    (SamplingParams(temperature=1.0), "dist"),
    (SamplingParams(temperature=0.7, top_k=3, frequency_penalty=0.8), "guess"),
    (SamplingParams(temperature=0.7, top_k=3, frequency_penalty=0.8), "dist"),
])
def test_distribution_matches_plain_sampling(sp: SamplingParams, drafter: str) -> None:
    n, runs = 3, 2500
    exact = _exact(sp, n)
    counts = dict.fromkeys(exact, 0)
    for seed in range(runs):
        counts[_generate_spec(sp, n, seed, drafter)] += 1
    keys = [s for s in exact if exact[s] > 0]
    assert sum(counts[s] for s in exact if exact[s] == 0) == 0
    obs = np.array([counts[s] for s in keys], dtype=float)
    exp = np.array([exact[s] for s in keys]) * runs
    exp *= obs.sum() / exp.sum()
    # Pool the rare outcomes so chi-square's expected counts are >= 5.
    rare = exp < 5
    obs = np.append(obs[~rare], obs[rare].sum())
    exp = np.append(exp[~rare], exp[rare].sum())
    stat = float(((obs - exp) ** 2 / exp).sum())
    p = _chi2_sf(stat, len(obs) - 1)
    tv = 0.5 * np.abs(obs / runs - exp / runs).sum()
    assert p > 1e-4, (p, tv)
    assert tv < 0.06


def test_greedy_verification_equals_greedy_steps() -> None:
    sp = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    rng = np.random.default_rng(0)
    for _ in range(50):
        out: list[int] = []
        plain: list[int] = []
        while len(plain) < 6:
            meta = _meta([sp], [plain])
            x = processed_logits(_logits(PROMPT + plain).unsqueeze(0), meta)
            plain.append(int(x.argmax()))
        while len(out) < 6:
            ctx = PROMPT + out
            d = rng.integers(0, V, size=int(rng.integers(0, 4))).tolist()
            if rng.random() < 0.5:  # often a correct prefix
                d = plain[len(out) : len(out) + len(d)]
            p_rows, o_rows = expand_for_verify([sp], [out], [d])
            logits = torch.stack([_logits(ctx + d[:j]) for j in range(len(d) + 1)])
            res = rejection_sample(logits, _meta(p_rows, o_rows), [d])
            assert res.tokens[0][: res.num_accepted[0]] == d[: res.num_accepted[0]]
            out += res.tokens[0]
        assert out[:6] == plain


def test_batch_rows_and_errors() -> None:
    sps = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=5)]
    drafts = [[1, 2], []]
    p_rows, o_rows = expand_for_verify(sps, [[], [3]], drafts)
    logits = torch.randn(4, V)
    res = rejection_sample(logits, _meta(p_rows, o_rows), drafts)
    assert res.rows[1] == [3] and res.rows[0][0] == 0
    with pytest.raises(ValueError, match="logits rows"):
        rejection_sample(logits[:3], _meta(p_rows[:3], o_rows[:3]), drafts)


@pytest.mark.parametrize("m", [1, 2, 3])
def test_all_accepted_drafts_take_the_bonus_from_the_row_after_them(m: int) -> None:
    """Rows where each draft has probability 1 (logit 100 against 0: every draft accepted)
    and row ``m`` (after the drafts) puts all its mass on token 4: the bonus is token 4."""
    sp = SamplingParams(temperature=1.0, seed=1)
    d = [(1 + j) % 4 for j in range(m)]
    logits = torch.zeros(m + 1, V)
    for j, t in enumerate(d):
        logits[j, t] = 100.0
    logits[m, 4] = 100.0
    p_rows, o_rows = expand_for_verify([sp], [[]], [d])
    for seed in range(20):
        res = rejection_sample(logits, _meta(p_rows, o_rows), [d],
                               {0: torch.Generator().manual_seed(seed)})
        assert res.num_accepted == [m] and res.tokens == [d + [4]]
        assert res.rows == [list(range(m + 1))]


def _rows(supports: list[tuple[int, ...]]) -> torch.Tensor:
    """Logits rows uniform over each support (exactly 1/len per token after softmax)."""
    x = torch.full((len(supports), V), float("-inf"))
    for j, sup in enumerate(supports):
        x[j, list(sup)] = 0.0
    return x


def _expected(d: list[int], seed: int, ratio: float, resid: int, bonus: int):
    """The documented rule with the request's own generator: its first ``len(d)`` draws
    are the uniforms, accepted while ``u < ratio``; the token after is the residual's only
    token (or the bonus row's only token when every draft is accepted)."""
    u = torch.rand(len(d), generator=torch.Generator().manual_seed(seed))
    a = 0
    while a < len(d) and bool(u[a] < torch.tensor(ratio, dtype=torch.float32)):
        a += 1
    return d[:a] + [resid if a < len(d) else bonus], a


@pytest.mark.parametrize("q_of_draft", [None, 1.0, 0.75, 0.25])
def test_accepted_counts_follow_the_requests_own_uniforms(q_of_draft) -> None:
    """Two requests in one verify batch, each with its own seeded generator. Every draft
    row gives its draft probability 1/2 and token 4 the other half; the row after the
    drafts puts everything on token 0. A draft is accepted while ``u < p / q``: 1/2 for a
    deterministic drafter (``q`` one-hot) or ``q(d) = 1``, 2/3 for ``q(d) = 3/4``, always for
    ``q(d) = 1/4``. A rejected draft is replaced by the residual ``max(p - q, 0)``, whose
    only token is 4; all accepted take the bonus 0. Each request's verdict depends only on
    its own generator."""
    sp = SamplingParams(temperature=1.0)
    drafts = [[1, 2, 1], [2, 1]]
    logits = torch.cat([_rows([(t, 4) for t in d] + [(0,)]) for d in drafts])
    p_rows, o_rows = expand_for_verify([sp, sp], [[], []], drafts)
    qs = None
    if q_of_draft is not None:  # q(d) on the draft, the rest on token 3 (p(3) = 0)
        qs = []
        for d in drafts:
            q = torch.zeros(len(d), V)
            for j, t in enumerate(d):
                q[j, t], q[j, 3] = q_of_draft, 1.0 - q_of_draft
            qs.append(q)
    ratio = 0.5 / (q_of_draft or 1.0)
    seen = set()
    for seed in range(24):
        gens = {0: torch.Generator().manual_seed(seed),
                1: torch.Generator().manual_seed(1000 + seed)}
        res = rejection_sample(logits, _meta(p_rows, o_rows), drafts, gens, qs)
        want = [_expected(d, s, ratio, 4, 0) for d, s in zip(drafts, (seed, 1000 + seed),
                                                              strict=True)]
        assert res.tokens == [w[0] for w in want]
        assert res.num_accepted == [w[1] for w in want]
        assert res.rows == [list(range(want[0][1] + 1)),
                            list(range(4, 4 + want[1][1] + 1))]
        seen.update(w[1] for w in want)
    # the cases are all reached: every count for q(d) <= 1, all accepted for q(d) = 1/4
    assert seen == ({3, 2} if q_of_draft == 0.25 else {0, 1, 2, 3})
