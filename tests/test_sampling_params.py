"""SamplingParams: defaults, normalisation and validation messages."""

from __future__ import annotations

import pytest

from pagefold.sampling_params import MAX_LOGPROBS, SamplingParams


def test_defaults_match_vllm() -> None:
    sp = SamplingParams()
    assert sp.n == 1 and sp.best_of == 1
    assert sp.temperature == 1.0 and sp.top_p == 1.0 and sp.top_k == 0 and sp.min_p == 0.0
    assert sp.seed is None
    assert sp.presence_penalty == 0.0 and sp.frequency_penalty == 0.0
    assert sp.repetition_penalty == 1.0
    assert sp.stop == [] and sp.stop_token_ids == []
    assert not sp.include_stop_str_in_output and not sp.ignore_eos
    assert sp.max_tokens == 16 and sp.min_tokens == 0
    assert sp.logprobs is None and sp.prompt_logprobs is None
    assert sp.skip_special_tokens and sp.detokenize
    assert not sp.is_greedy and not sp.uses_penalties


def test_normalisation() -> None:
    sp = SamplingParams(stop="###", top_k=-1, temperature=0, stop_token_ids=(7, 8))
    assert sp.stop == ["###"]
    assert sp.top_k == 0
    assert sp.stop_token_ids == [7, 8]
    assert isinstance(sp.temperature, float) and sp.is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy
    assert SamplingParams(n=3).best_of == 3
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(repetition_penalty=1.1).uses_penalties


def test_all_stop_token_ids() -> None:
    sp = SamplingParams(stop_token_ids=[5])
    assert sp.all_stop_token_ids(2) == {2, 5}
    assert sp.all_stop_token_ids(None) == {5}
    assert SamplingParams(ignore_eos=True).all_stop_token_ids(2) == set()


def test_clone_is_deep() -> None:
    sp = SamplingParams(stop=["a"], stop_token_ids=[1], seed=3, temperature=0.5)
    c = sp.clone()
    assert c == sp and c is not sp
    c.stop.append("b")
    c.stop_token_ids.append(2)
    assert sp.stop == ["a"] and sp.stop_token_ids == [1]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1.0}, "temperature must be >= 0, got -1.0"),
        ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_k": -2}, "top_k must be -1 (off), 0 (off) or >= 1, got -2"),
        ({"top_k": 2.5}, "top_k must be an int, got 2.5"),
        ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1"),
        ({"min_p": 1.1}, "min_p must be in [0, 1], got 1.1"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, got 0.0"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3.0"),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
        ({"max_tokens": 1.0}, "max_tokens must be an int or None, got 1.0"),
        ({"min_tokens": -1}, "min_tokens must be >= 0, got -1"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be <= max_tokens (4), got 5"),
        ({"logprobs": -1}, f"logprobs must be in [0, {MAX_LOGPROBS}], got -1"),
        ({"logprobs": 21}, f"logprobs must be in [0, {MAX_LOGPROBS}], got 21"),
        ({"prompt_logprobs": 99}, f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got 99"),
        ({"n": 0}, "n must be at least 1, got 0"),
        ({"n": 3, "best_of": 2}, "best_of must be greater than or equal to n (3), got 2"),
        ({"seed": 1.5}, "seed must be an int or None, got 1.5"),
        ({"seed": True}, "seed must be an int or None, got True"),
        ({"stop": ["ok", ""]}, "stop must contain only non-empty strings, got ''"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be non-negative ints, got -1"),
    ],
)
def test_validation_messages(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    assert str(exc.value) == message


def test_boundaries_accepted() -> None:
    SamplingParams(
        temperature=0.0,
        top_p=1.0,
        top_k=1,
        min_p=1.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=1e-3,
        max_tokens=1,
        min_tokens=1,
        logprobs=MAX_LOGPROBS,
        prompt_logprobs=0,
        n=2,
        best_of=2,
        seed=0,
    )
    SamplingParams(max_tokens=None, min_tokens=1000)


@pytest.mark.parametrize("kw", [
    {"temperature": float("nan")}, {"temperature": float("inf")}, {"top_p": float("nan")},
    {"min_p": float("nan")}, {"presence_penalty": float("-inf")},
    {"repetition_penalty": float("nan")}, {"temperature": 10**400},
    {"seed": 2**64}, {"seed": -(2**63) - 1}, {"stop_token_ids": [2**63]},
])
def test_non_finite_and_out_of_range_numbers_rejected(kw):
    field = next(iter(kw))
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_large_in_range_seed_accepted():
    assert SamplingParams(seed=2**62).seed == 2**62
