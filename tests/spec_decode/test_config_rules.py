"""``speculative_config``'s rules, each worked out by hand from the module docstring and vLLM's
dictionary interface: every method's fields and defaults, the aliases, every error with its
exact message, ``to_dict``'s keys, and ``check_model_supports`` per method (written for
mutmut's survivors on ``spec_decode/config.py``; no model is built)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from pagefold.spec_decode.config import SpeculativeConfig, check_model_supports

# Fields in declaration order: method, k, prompt_lookup_max, prompt_lookup_min, model,
# disable_by_batch_size, adaptive_k.
_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
           "model", "disable_by_batch_size", "adaptive_k")


def _fields(c: SpeculativeConfig) -> tuple:
    return tuple(getattr(c, f) for f in _FIELDS)


@pytest.mark.parametrize("value, want", [
    # n-gram defaults: max 5, min min(max, 2) when max is given and non-zero.
    ({"method": "ngram", "num_speculative_tokens": 3}, ("ngram", 3, 5, 2, None, None, False)),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 1},
     ("ngram", 3, 1, 1, None, None, False)),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
     ("ngram", 3, 3, 2, None, None, False)),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5},
     ("ngram", 3, 5, 5, None, None, False)),
    ({"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1,
      "prompt_lookup_max": 1}, ("ngram", 1, 1, 1, None, None, False)),
    ({"method": "ngram", "num_speculative_tokens": 16}, ("ngram", 16, 5, 2, None, None, False)),
    # A 'model' is dropped for methods that do not draft with a checkpoint.
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/m"},
     ("ngram", 2, 5, 2, None, None, False)),
    ({"method": "mtp", "model": "/m"}, ("mtp", 1, 0, 0, None, None, False)),
    ({"method": "mtp", "num_speculative_tokens": 4}, ("mtp", 4, 0, 0, None, None, False)),
    # No method: the model names it ('ngram' / '[ngram]' are vLLM's n-gram spellings).
    ({"model": "ngram", "num_speculative_tokens": 2}, ("ngram", 2, 5, 2, None, None, False)),
    ({"model": "[ngram]", "num_speculative_tokens": 2}, ("ngram", 2, 5, 2, None, None, False)),
    ({"model": "/d", "num_speculative_tokens": 2}, ("draft_model", 2, 0, 0, "/d", None, False)),
    # Aliases.
    ({"method": "draft", "model": "/d", "num_speculative_tokens": 2},
     ("draft_model", 2, 0, 0, "/d", None, False)),
    ({"method": "[ngram]", "num_speculative_tokens": 2}, ("ngram", 2, 5, 2, None, None, False)),
    ({"method": "qwen3_next_mtp"}, ("mtp", 1, 0, 0, None, None, False)),
    ({"method": "eagle", "model": "/e", "num_speculative_tokens": 3},
     ("eagle", 3, 0, 0, "/e", None, False)),
    # Zero lookup fields are "not given" for the other methods.
    ({"method": "eagle", "model": "/e", "num_speculative_tokens": 3, "prompt_lookup_max": 0,
      "prompt_lookup_min": 0}, ("eagle", 3, 0, 0, "/e", None, False)),
    # None means "not given" for every key.
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": None,
      "prompt_lookup_max": None, "adaptive_k": None},
     ("ngram", 2, 5, 2, None, None, False)),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1,
      "draft_tensor_parallel_size": 1, "adaptive_k": True},
     ("ngram", 2, 5, 2, None, 1, True)),
    ({"method": "ngram", "num_speculative_tokens": 2, "adaptive_k": False},
     ("ngram", 2, 5, 2, None, None, False)),
])
def test_fields_and_defaults(value, want) -> None:
    assert _fields(SpeculativeConfig.from_user(value)) == want


def test_off_and_passthrough() -> None:
    assert SpeculativeConfig.from_user(None) is None
    assert SpeculativeConfig.from_user({}) is None
    assert SpeculativeConfig.from_user("{}") is None
    assert SpeculativeConfig.from_user({"method": None, "model": None}) is None
    c = SpeculativeConfig("ngram", 2, 5, 2)
    assert SpeculativeConfig.from_user(c) is c


_KNOWN = ("['adaptive_k', 'disable_by_batch_size', 'draft_tensor_parallel_size', 'method', "
          "'model', 'num_speculative_tokens', 'prompt_lookup_max', 'prompt_lookup_min']")


@pytest.mark.parametrize("bad, msg", [
    ({"method": "ngram", "num_speculative_tokens": 2, "zz": 1, "aa": 2},
     f"speculative_config has unknown key(s) ['aa', 'zz']; known: {_KNOWN}"),
    ({"num_speculative_tokens": 2},
     "speculative_config needs a 'method' (ngram, mtp, eagle, eagle3) or a draft 'model' path"),
    ({"method": "medusa", "num_speculative_tokens": 2},
     "speculative method 'medusa' is not supported; use one of ngram, draft_model, mtp, eagle, "
     "eagle3"),
    ({"method": 7, "num_speculative_tokens": 2},
     "speculative method '7' is not supported; use one of ngram, draft_model, mtp, eagle, "
     "eagle3"),
    ({"method": "eagle", "model": "", "num_speculative_tokens": 2},
     "speculative method 'eagle' needs 'model': a local path"),
    ({"method": "draft", "num_speculative_tokens": 2},
     "speculative method 'draft_model' needs 'model': a local path"),
    ({"method": "eagle", "model": "/e"}, "speculative method 'eagle' needs num_speculative_tokens"),
    ({"model": "/d"}, "speculative method 'draft_model' needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0},
     "num_speculative_tokens must be in 1..16, got 0"),
    ({"method": "ngram", "num_speculative_tokens": 17},
     "num_speculative_tokens must be in 1..16, got 17"),
    ({"method": "mtp", "num_speculative_tokens": True},
     "num_speculative_tokens must be an integer, got True"),
    ({"method": "ngram", "num_speculative_tokens": "3"},
     "num_speculative_tokens must be an integer, got '3'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2.0},
     "prompt_lookup_max must be an integer, got 2.0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": False},
     "prompt_lookup_min must be an integer, got False"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0},
     "need 1 <= prompt_lookup_min <= prompt_lookup_max, got prompt_lookup_min=1, "
     "prompt_lookup_max=0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
     "need 1 <= prompt_lookup_min <= prompt_lookup_max, got prompt_lookup_min=0, "
     "prompt_lookup_max=5"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 6},
     "need 1 <= prompt_lookup_min <= prompt_lookup_max, got prompt_lookup_min=6, "
     "prompt_lookup_max=5"),
    ({"method": "mtp", "prompt_lookup_min": 2},
     "prompt_lookup_max/min only apply to method 'ngram'"),
    ({"method": "eagle", "model": "/e", "num_speculative_tokens": 2, "prompt_lookup_max": 4},
     "prompt_lookup_max/min only apply to method 'ngram'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
     "disable_by_batch_size must be >= 1, got 0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": "4"},
     "disable_by_batch_size must be an integer, got '4'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
     "draft_tensor_parallel_size must be 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "adaptive_k": 1},
     "adaptive_k must be true or false, got 1"),
    ([1, 2], "speculative_config must be a dict or a JSON object, got list"),
])
def test_errors_exact(bad, msg) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        SpeculativeConfig.from_user(bad)


@pytest.mark.parametrize("value, want", [
    ({"method": "ngram", "num_speculative_tokens": 3},
     {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5,
      "prompt_lookup_min": 2}),
    ({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 8,
      "adaptive_k": True},
     {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5,
      "prompt_lookup_min": 2, "disable_by_batch_size": 8, "adaptive_k": True}),
    ({"method": "mtp"}, {"method": "mtp", "num_speculative_tokens": 1}),
    ({"method": "eagle3", "model": "/h", "num_speculative_tokens": 2, "adaptive_k": False},
     {"method": "eagle3", "num_speculative_tokens": 2, "model": "/h"}),
])
def test_to_dict_keys(value, want) -> None:
    out = SpeculativeConfig.from_user(value).to_dict()
    assert out == want and list(out) == list(want)


_MTP_ERR = (
    "speculative method 'mtp' needs a checkpoint with multi-token-prediction weights "
    "(Qwen3-Next / Qwen3.5 with mtp_num_hidden_layers >= 1); this {} model declares none. "
    "Use {{\"method\": \"ngram\", ...}} or a draft 'model' instead."
)


@pytest.mark.parametrize("cfg, model_type", [
    ({"model_type": "llama", "mtp_num_hidden_layers": 1}, "llama"),
    ({"model_type": "qwen3_next"}, "qwen3_next"),
    ({"model_type": "qwen3_next", "mtp_num_hidden_layers": 0, "num_nextn_predict_layers": 0},
     "qwen3_next"),
    # The text config's model_type is named first, the top one when it has none.
    ({"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text"}}, "qwen3_5_text"),
    ({"model_type": "qwen3_5_moe", "text_config": {}}, "qwen3_5_moe"),
    # Attribute-style configs (transformers' PretrainedConfig) read the same.
    (SimpleNamespace(model_type="qwen3_next", mtp_num_hidden_layers=0), "qwen3_next"),
])
def test_mtp_rejected_exact(cfg, model_type) -> None:
    spec = SpeculativeConfig.from_user({"method": "mtp"})
    msg = _MTP_ERR.format(model_type)
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        check_model_supports(spec, cfg)


@pytest.mark.parametrize("cfg", [
    {"model_type": "qwen3_next", "mtp_num_hidden_layers": 1},
    {"model_type": "qwen3_next", "num_nextn_predict_layers": 2},
    {"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text",
                                              "mtp_num_hidden_layers": 1}},
    SimpleNamespace(model_type="qwen3_next", mtp_num_hidden_layers=1),
    SimpleNamespace(model_type="qwen3_next", num_nextn_predict_layers=1),
])
def test_mtp_accepted(cfg) -> None:
    check_model_supports(SpeculativeConfig.from_user({"method": "mtp"}), cfg)


def test_draft_vocab_rule() -> None:
    dm = SpeculativeConfig.from_user({"model": "/d", "num_speculative_tokens": 2})
    target = {"model_type": "llama", "vocab_size": 10}
    msg = ("the draft model's vocab_size 11 differs from the target's 10; a draft model must "
           "share the target's tokenizer")
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        check_model_supports(dm, target, {"model_type": "llama", "vocab_size": 11})
    # Nested text configs and attribute configs are read through to the vocabulary.
    msg_n = msg.replace("11", "12")
    with pytest.raises(ValueError, match=f"^{re.escape(msg_n)}$"):
        check_model_supports(dm, {"text_config": {"vocab_size": 10}, "vocab_size": 12},
                             SimpleNamespace(text_config=SimpleNamespace(vocab_size=12)))
    check_model_supports(dm, target, {"model_type": "llama", "vocab_size": 10})
    check_model_supports(dm, target, SimpleNamespace(vocab_size=10))
    check_model_supports(dm, target)  # no draft config: nothing to compare
    # Only a draft model's vocabulary is checked here; the other methods pass whatever it is.
    for spec in ({"method": "eagle", "model": "/e", "num_speculative_tokens": 2},
                 {"method": "ngram", "num_speculative_tokens": 2}):
        check_model_supports(SpeculativeConfig.from_user(spec), target,
                             {"model_type": "llama", "vocab_size": 11})
