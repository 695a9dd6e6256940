"""Batched sampler: greedy, truncation, seeds, penalties, min_tokens, logprobs, distribution."""

from __future__ import annotations

import math

import pytest
import torch

from pagefold.executor.sampler import (
    Sampler,
    SamplingMetadata,
    apply_penalties,
    gather_logprobs,
    make_generator,
    plain_greedy,
)
from pagefold.sampling_params import SamplingParams

sampler = Sampler()

PROBS4 = [0.5, 0.3, 0.15, 0.05]


def _meta(params, outputs=None, prompts=None, generators=None, eos=None) -> SamplingMetadata:
    outputs = outputs if outputs is not None else [[] for _ in params]
    return SamplingMetadata.build(params, outputs, prompts, generators, eos_token_ids=eos)


def _frequencies(tokens: torch.Tensor, v: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=v).float() / tokens.numel()


def _logits4(rows: int) -> torch.Tensor:
    return torch.tensor(PROBS4).log().expand(rows, 4)


def test_greedy_is_argmax_and_input_untouched() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    before = logits.clone()
    out = sampler(logits, _meta([SamplingParams(temperature=0.0)] * 6))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None and out.ranks is None
    # Penalties, masks and truncation must not write into the caller's tensor either.
    params = [
        SamplingParams(temperature=0.7, top_k=3, top_p=0.9, min_p=0.1, repetition_penalty=1.5,
                       min_tokens=2, logprobs=2)
    ] * 6
    sampler(logits, _meta(params, outputs=[[1, 2]] * 6, prompts=[[3]] * 6, eos=0))
    assert torch.equal(logits, before)


def test_mixed_greedy_and_random_rows() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 30)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=5.0),
    ]
    meta = _meta(params)
    assert not meta.all_greedy and not meta.all_random
    for _ in range(10):
        out = sampler(logits, meta).sampled_token_ids
        assert torch.equal(out[:3], logits[:3].argmax(dim=1))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=1),
        SamplingParams(top_p=1e-6),
        SamplingParams(min_p=1.0),
        SamplingParams(temperature=0.3, top_k=1, top_p=0.5),
    ],
    ids=["top_k=1", "top_p_tiny", "min_p=1", "combined"],
)
def test_truncation_to_one_token_equals_greedy(params: SamplingParams) -> None:
    torch.manual_seed(2)
    # Flat logits: without truncation almost every draw would differ from the argmax.
    logits = torch.randn(64, 200) * 0.1
    meta = _meta([params] * 64)
    assert meta.all_random
    for _ in range(3):
        assert torch.equal(sampler(logits, meta).sampled_token_ids, logits.argmax(dim=1))


def test_softmax_distribution_unseeded() -> None:
    torch.manual_seed(3)
    n = 20000
    out = sampler(_logits4(n), _meta([SamplingParams()] * n)).sampled_token_ids
    freq = _frequencies(out, 4)
    assert torch.allclose(freq, torch.tensor(PROBS4), atol=0.02), freq


def test_temperature_distribution_seeded_rows() -> None:
    # Every row with its own generator: exercises the per-row noise path.
    n, temp = 4000, 2.0
    gens = {i: make_generator(1000 + i) for i in range(n)}
    out = sampler(_logits4(n), _meta([SamplingParams(temperature=temp, seed=1)] * n,
                                     generators=gens)).sampled_token_ids
    expected = (torch.tensor(PROBS4).log() / temp).softmax(0)
    freq = _frequencies(out, 4)
    assert torch.allclose(freq, expected, atol=0.03), (freq, expected)


@pytest.mark.parametrize(
    "params, expected",
    [
        # top-k 2: renormalised over the two best.
        (SamplingParams(top_k=2), [0.625, 0.375, 0.0, 0.0]),
        # top-p 0.7: mass before token 1 is 0.5 < 0.7 (kept), before token 2 is 0.8 (dropped).
        (SamplingParams(top_p=0.7), [0.625, 0.375, 0.0, 0.0]),
        # min-p 0.2: threshold 0.1 drops only the last token.
        (SamplingParams(min_p=0.2), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        # top-k 3 then top-p 0.9 on the renormalised [.526, .316, .158]: all three stay.
        (SamplingParams(top_k=3, top_p=0.9), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
    ],
    ids=["top_k", "top_p", "min_p", "top_k_top_p"],
)
def test_truncated_distributions(params: SamplingParams, expected: list[float]) -> None:
    torch.manual_seed(4)
    n = 20000
    out = sampler(_logits4(n), _meta([params] * n)).sampled_token_ids
    freq = _frequencies(out, 4)
    exp = torch.tensor(expected)
    assert torch.all(freq[exp == 0] == 0), freq
    assert torch.allclose(freq, exp, atol=0.02), freq


def test_per_row_truncation_settings_in_one_batch() -> None:
    n = 6000
    params = [SamplingParams(top_k=1), SamplingParams(), SamplingParams(top_p=0.7)] * (n // 3)
    torch.manual_seed(5)
    out = sampler(_logits4(n), _meta(params)).sampled_token_ids.view(-1, 3)
    assert torch.all(out[:, 0] == 0)
    assert set(out[:, 1].tolist()) == {0, 1, 2, 3}
    assert set(out[:, 2].tolist()) == {0, 1}


def _seeded_run(seed: int, logits_seq: list[torch.Tensor], batch_builder) -> list[int]:
    g = make_generator(seed)
    tokens = []
    for step_logits in logits_seq:
        logits, params, row, gens = batch_builder(step_logits, g)
        out = sampler(logits, _meta(params, generators=gens)).sampled_token_ids
        tokens.append(int(out[row]))
    return tokens


def test_seed_reproducible_and_batch_independent() -> None:
    torch.manual_seed(6)
    v = 1000
    steps = [torch.randn(v) * 0.2 for _ in range(8)]  # high entropy: tokens depend on noise
    sp = SamplingParams(seed=1234, temperature=0.9)

    def alone(x, g):
        return x.unsqueeze(0), [sp], 0, {0: g}

    def crowded(x, g):
        # Different neighbours, position 2, another seeded row and unseeded rows.
        logits = torch.randn(5, v)
        logits[2] = x
        params = [SamplingParams(), SamplingParams(seed=7), sp, SamplingParams(temperature=0.0),
                  SamplingParams(top_k=5)]
        return logits, params, 2, {1: make_generator(7), 2: g}

    def last(x, g):
        logits = torch.randn(3, v)
        logits[2] = x
        return logits, [SamplingParams(top_p=0.5)] * 2 + [sp], 2, {2: g}

    ref = _seeded_run(1234, steps, alone)
    assert _seeded_run(1234, steps, alone) == ref
    assert _seeded_run(1234, steps, crowded) == ref
    assert _seeded_run(1234, steps, last) == ref
    assert _seeded_run(4321, steps, alone) != ref


def test_penalties_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0], [2.0, -1.0, 0.5, -0.5, 1.0]])
    params = [
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),
    ]
    meta = _meta(params, outputs=[[1, 1, 2], [0, 1]], prompts=[[0], [4]])
    assert not meta.no_penalties
    out = apply_penalties(logits, meta)
    # token 0: prompt, positive -> 2/2; token 1: output x2, negative -> -1*2 - 0.5 - 2*0.25;
    # token 2: output x1, positive -> 0.5/2 - 0.5 - 0.25; tokens 3, 4: untouched.
    expected0 = torch.tensor([1.0, -3.0, -0.5, -0.5, 1.0])
    assert torch.allclose(out[0], expected0)
    assert torch.equal(out[1], logits[1])


def test_presence_and_frequency_without_repetition() -> None:
    logits = torch.zeros(1, 4)
    meta = _meta([SamplingParams(presence_penalty=-1.0, frequency_penalty=0.5)],
                 outputs=[[3, 3, 3, 0]])
    assert meta.prompt_token_ids is None  # prompt tokens only matter for repetition penalty
    out = apply_penalties(logits, meta)
    assert torch.allclose(out[0], torch.tensor([1.0 - 0.5, 0.0, 0.0, 1.0 - 1.5]))


def test_penalties_steer_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    greedy = SamplingParams(temperature=0.0)
    assert int(sampler(logits, _meta([greedy])).sampled_token_ids[0]) == 0
    pen = SamplingParams(temperature=0.0, frequency_penalty=0.2)
    assert int(sampler(logits, _meta([pen], outputs=[[0]])).sampled_token_ids[0]) == 1
    rep = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    meta = _meta([rep], outputs=[[]], prompts=[[0]])  # 3.0 / 1.2 = 2.5 < 2.9
    assert int(sampler(logits, meta).sampled_token_ids[0]) == 1


def test_min_tokens_bans_eos_and_stop_ids() -> None:
    eos = 0
    logits = torch.tensor([[5.0, 4.0, 3.0, 1.0]]).repeat(3, 1)
    params = [
        SamplingParams(temperature=0.0, min_tokens=3),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[1]),
        SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True),
    ]
    meta = _meta(params, outputs=[[2], [2, 2], [2]], eos=eos)
    assert meta.stop_ids_to_mask == {0: {0}, 1: {0, 1}}
    assert sampler(logits, meta).sampled_token_ids.tolist() == [1, 2, 0]
    # Once min_tokens is reached, EOS is allowed again.
    meta = _meta(params, outputs=[[2, 2, 2]] * 3, eos=eos)
    assert meta.stop_ids_to_mask == {}
    assert sampler(logits, meta).sampled_token_ids.tolist() == [0, 0, 0]
    # Random rows: the banned id is never drawn.
    torch.manual_seed(7)
    meta = _meta([SamplingParams(min_tokens=1)] * 2000, eos=eos)
    assert not torch.any(sampler(logits[:1].expand(2000, 4), meta).sampled_token_ids == eos)


def test_logprobs_from_raw_logits_and_ranks() -> None:
    torch.manual_seed(8)
    logits = torch.randn(4, 40)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.5, top_k=10, logprobs=1, presence_penalty=1.5),
        SamplingParams(temperature=1.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, min_tokens=2, logprobs=0),
    ]
    meta = _meta(params, outputs=[[1], [2, 3], [4], []], prompts=[[5]] * 4,
                 eos=int(logits[3].argmax()))
    assert meta.max_num_logprobs == 3
    out = sampler(logits, meta)
    raw = torch.log_softmax(logits, dim=1)
    tok = out.sampled_token_ids
    assert out.logprobs_token_ids.shape == (4, 4) and out.logprobs.shape == (4, 4)
    assert torch.equal(out.logprobs_token_ids[:, 0], tok)
    assert torch.allclose(out.logprobs[:, 0], raw.gather(1, tok[:, None])[:, 0])
    top = raw.topk(3, dim=1)
    assert torch.equal(out.logprobs_token_ids[:, 1:], top.indices)
    assert torch.allclose(out.logprobs[:, 1:], top.values)
    order = raw.argsort(dim=1, descending=True)
    expected_ranks = [int((order[i] == tok[i]).nonzero()) + 1 for i in range(4)]
    assert out.ranks.tolist() == expected_ranks
    assert out.ranks[0] == 1  # greedy without penalties picks the best raw token
    assert out.ranks[3] == 2  # the raw argmax is EOS, banned by min_tokens


def test_gather_logprobs_k0_and_ties() -> None:
    lp = torch.log_softmax(torch.tensor([[1.0, 1.0, 0.0], [0.0, 2.0, 1.0]]), dim=1)
    ids, vals, ranks = gather_logprobs(lp, torch.tensor([1, 0]), 0)
    assert ids.tolist() == [[1], [0]]
    assert torch.allclose(vals[:, 0], torch.stack([lp[0, 1], lp[1, 0]]))
    assert ranks.tolist() == [1, 3]  # a tie with the best still ranks 1
    assert math.isclose(float(vals.exp().sum()), float(lp[0, 1].exp() + lp[1, 0].exp()))


def test_half_precision_logits() -> None:
    torch.manual_seed(9)
    logits = torch.randn(3, 17).to(torch.bfloat16)
    out = sampler(logits, _meta([SamplingParams(temperature=0.0, logprobs=2)] * 3))
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(dim=1))
    assert out.logprobs.dtype == torch.float32


def test_build_errors() -> None:
    with pytest.raises(ValueError, match="output id lists"):
        SamplingMetadata.build([SamplingParams()], [], None)
    with pytest.raises(ValueError, match="prompt_ids_list"):
        SamplingMetadata.build([SamplingParams(repetition_penalty=1.2)], [[]], None)
    with pytest.raises(ValueError, match="logits must be"):
        sampler(torch.zeros(2, 5), _meta([SamplingParams()]))


def test_top_k_larger_than_vocab_and_greedy_generators_dropped() -> None:
    torch.manual_seed(10)
    logits = torch.randn(2, 8)
    g = make_generator(3)
    state = g.get_state()
    params = [SamplingParams(temperature=0.0, seed=3), SamplingParams(top_k=50)]
    meta = _meta(params, generators={0: g})
    assert meta.generators == {} and meta.max_top_k == 50
    out = sampler(logits, meta).sampled_token_ids
    assert int(out[0]) == int(logits[0].argmax())
    assert torch.equal(g.get_state(), state)  # a greedy row's generator is not advanced


def test_hand_built_metadata_top_k() -> None:
    # Built without ``build``: max_top_k is left at 0 and read from the tensor instead.
    torch.manual_seed(11)
    logits = torch.randn(3, 12) * 0.1
    meta = SamplingMetadata(
        temperature=torch.ones(3), all_greedy=False, all_random=True,
        top_k=torch.tensor([1, 0, 1]),
    )
    for _ in range(5):
        out = sampler(logits, meta).sampled_token_ids
        assert out[[0, 2]].tolist() == logits[[0, 2]].argmax(dim=1).tolist()


@pytest.mark.parametrize("kw,plain", [
    ({}, True), ({"max_tokens": 7, "seed": 3}, True),
    ({"temperature": 0.7}, False), ({"repetition_penalty": 1.3}, False),
    ({"presence_penalty": 0.5}, False), ({"frequency_penalty": 0.5}, False),
    ({"min_tokens": 2}, False), ({"logprobs": 0}, False), ({"logprob_token_ids": [1]}, False),
    ({"logit_bias": {1: 5.0}}, False), ({"allowed_token_ids": [1, 2]}, False),
])
def test_plain_greedy_rows_are_the_samplers_argmax(kw, plain):
    """``plain_greedy`` holds exactly for rows whose sampling is the raw argmax (the runner
    then skips the metadata): each feature that changes a row's token or output says no."""
    sp = SamplingParams(temperature=0.0, **kw) if "temperature" not in kw else \
        SamplingParams(**kw)
    assert plain_greedy(sp) is plain
    if plain:
        logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(5))
        got = sampler(logits, _meta([sp, sp], eos=[1, 1]))
        assert torch.equal(got.sampled_token_ids, Sampler.argmax(logits))
        assert got.logprobs is None


def test_argmax_numpy_shortcut_equals_torch_max_on_ties_nan_and_infinities():
    """``Sampler.argmax`` takes numpy's argmax for CPU rows: the same index as torch's
    ``max(dim).indices`` (first maximum; the first NaN wins) on ties, NaN, +-inf and signed
    zeros, int64; a tensor that requires grad takes torch's path, same answer."""
    g = torch.Generator().manual_seed(3)
    cases = []
    for v in (1, 2, 7, 1000):
        x = torch.randint(-2, 2, (5, v), generator=g).float()  # many ties
        cases.append(x)
        y = x.clone()
        y[torch.rand(5, v, generator=g) < 0.2] = float("nan")
        cases.append(y)
        z = x.clone()
        z[torch.rand(5, v, generator=g) < 0.3] = float("-inf")
        z[torch.rand(5, v, generator=g) < 0.1] = float("inf")
        cases.append(torch.where(z == 0, torch.tensor(-0.0), z))
    cases.append(torch.tensor([[0.0, -0.0, float("nan"), 1.0, float("nan")]]))
    cases.append(torch.randn(3, 40, generator=g).bfloat16())
    for x in cases:
        want = x.float().max(dim=1).indices
        got = Sampler.argmax(x)
        assert got.dtype == torch.int64 and torch.equal(got, want), x
    assert Sampler.argmax(cases[-2]).tolist() == [2]
    w = torch.randn(2, 9, generator=g).requires_grad_()
    assert torch.equal(Sampler.argmax(w), w.detach().max(dim=1).indices)
