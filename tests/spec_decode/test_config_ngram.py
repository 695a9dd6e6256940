"""speculative_config parsing and the n-gram proposer (vectorised vs the definition)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from pagefold.spec_decode.config import SpeculativeConfig, check_model_supports
from pagefold.spec_decode.ngram import NgramProposer, ngram_propose, ngram_propose_naive


def test_parse_vllm_forms() -> None:
    c = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 3,
                                     "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (
        "ngram", 3, 2, 4)
    d = SpeculativeConfig.from_user('{"model": "/tmp/draft", "num_speculative_tokens": 2}')
    assert d.method == "draft_model" and d.model == "/tmp/draft"
    m = SpeculativeConfig.from_user({"method": "mtp"})
    assert m.method == "mtp" and m.num_speculative_tokens == 1 and m.model is None
    e = SpeculativeConfig.from_user({"method": "eagle3", "model": "/tmp/h",
                                     "num_speculative_tokens": 3})
    assert (e.method, e.model, e.num_speculative_tokens) == ("eagle3", "/tmp/h", 3)
    assert SpeculativeConfig.from_user(None) is None and SpeculativeConfig.from_user({}) is None
    assert SpeculativeConfig.from_user(c.to_dict()) == c
    # The engine-process hand-off: dataclasses.asdict of EngineConfig, JSON, back.
    for spec in (c, d, m, e):
        assert SpeculativeConfig.from_user(json.loads(json.dumps(dataclasses.asdict(spec)))) == spec


@pytest.mark.parametrize("bad, msg", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "not supported"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "'eagle' needs 'model'"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "'eagle3' needs 'model'"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "1..16"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
      "prompt_lookup_max": 2}, "prompt_lookup_min <= prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "integer"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "mtp", "prompt_lookup_max": 3}, "only apply"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown key"),
    ("{not json", "not valid JSON"),
])
def test_parse_errors(bad, msg) -> None:
    with pytest.raises(ValueError, match=msg):
        SpeculativeConfig.from_user(bad)


def test_mtp_needs_mtp_weights() -> None:
    spec = SpeculativeConfig.from_user({"method": "mtp", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match="multi-token-prediction"):
        check_model_supports(spec, {"model_type": "llama", "vocab_size": 10})
    with pytest.raises(ValueError, match="multi-token-prediction"):
        check_model_supports(spec, {"model_type": "qwen3_next", "vocab_size": 10})
    check_model_supports(spec, {"model_type": "qwen3_next", "mtp_num_hidden_layers": 1})
    ng = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 2})
    check_model_supports(ng, {"model_type": "llama"})
    dm = SpeculativeConfig.from_user({"model": "/x", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="vocab_size"):
        check_model_supports(dm, {"model_type": "llama", "vocab_size": 10},
                             {"model_type": "llama", "vocab_size": 11})


def test_ngram_examples() -> None:
    t = np.array([1, 2, 3, 4, 9, 1, 2, 3], dtype=np.int64)
    assert ngram_propose(t, 3, 2, 4).tolist() == [4, 9, 1]
    # Longest match wins over a more recent shorter one.
    t = np.array([7, 2, 3, 5, 6, 0, 3, 8, 7, 2, 3], dtype=np.int64)
    assert ngram_propose(t, 2, 1, 3).tolist() == [5, 6]
    # Most recent occurrence among equally long matches.
    t = np.array([2, 3, 5, 2, 3, 6, 2, 3], dtype=np.int64)
    assert ngram_propose(t, 1, 2, 2).tolist() == [6]
    # Below min: nothing; truncated at the end of the context.
    assert ngram_propose(np.array([1, 2, 3, 1]), 3, 2, 3).tolist() == []
    assert ngram_propose(np.array([1, 2, 1, 2]), 5, 2, 3).tolist() == [1, 2]
    assert NgramProposer(3, 1, 2).propose([[4, 5, 4], [1]], max_tokens=[1, 3]) == [[5], []]


@pytest.mark.parametrize("seed", range(4))
def test_ngram_matches_definition(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(300):
        vocab = int(rng.integers(2, 6))
        t = rng.integers(0, vocab, size=int(rng.integers(1, 40)))
        lo = int(rng.integers(1, 4))
        hi = int(rng.integers(lo, 6))
        k = int(rng.integers(1, 5))
        assert ngram_propose(t, k, lo, hi).tolist() == ngram_propose_naive(t.tolist(), k, lo, hi)


def test_cli_flag_reaches_engine_config() -> None:
    import argparse

    from pagefold.config import EngineConfig
    from pagefold.entrypoints.cli import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--speculative-config", '{"method": "ngram", '
                         '"num_speculative_tokens": 2, "prompt_lookup_max": 3}'])
    cfg = EngineConfig(model="x", **engine_kwargs(args))
    assert cfg.speculative_config == SpeculativeConfig("ngram", 2, 3, 2)
    assert EngineConfig(model="x", **engine_kwargs(p.parse_args([]))).speculative_config is None
    with pytest.raises(ValueError, match="not supported"):
        EngineConfig(model="x", speculative_config={"method": "medusa",
                                                    "num_speculative_tokens": 2})
