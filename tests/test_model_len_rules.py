"""``core/model_len.py`` without a model: the positions limit and the ``max_model_len`` check
worked out by hand from the module docstring (vLLM's rule): the legacy ``rope_scaling`` and
``type`` spellings, a config without a limit, the override and its environment variable, the
exact error and warning (written for mutmut's survivors, see docs/TESTING.md)."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace as NS

import pytest

from pagefold.core.model_len import (
    derived_max_positions,
    long_allowed,
    resolve_max_model_len,
    rope_parameters,
)

ENV = "PAGEFOLD_ALLOW_LONG_MAX_MODEL_LEN"


def test_rope_parameters_spellings() -> None:
    linear = {"rope_type": "linear", "factor": 2.0}
    # Older configs name it rope_scaling; rope_parameters wins when both are set.
    assert rope_parameters(NS(rope_scaling=linear)) == linear
    assert rope_parameters(NS(rope_parameters=None, rope_scaling=linear)) == linear
    assert rope_parameters(NS(rope_parameters={"rope_type": "default"}, rope_scaling=linear)) == {
        "rope_type": "default"}
    assert rope_parameters(NS()) is None
    assert rope_parameters(NS(rope_parameters="linear")) is None  # not a dict: ignored
    # Through the limit: 4096 x 2 from the legacy field, the legacy "type" key.
    assert derived_max_positions(NS(max_position_embeddings=4096, rope_scaling=linear)) == 8192
    assert derived_max_positions(NS(max_position_embeddings=4096,
                                    rope_scaling={"type": "linear", "factor": 3.0})) == 12288
    assert derived_max_positions(NS(max_position_embeddings=4096,
                                    rope_parameters={"type": "llama3", "factor": 8.0})) == 4096
    assert derived_max_positions(NS(max_position_embeddings=1000,
                                    rope_parameters={"rope_type": "linear",
                                                     "type": "llama3", "factor": 2.0})) == 2000


def test_no_limit_in_the_config() -> None:
    assert derived_max_positions(NS()) is None
    assert derived_max_positions(NS(max_position_embeddings=0)) is None
    assert resolve_max_model_len(None, NS()) == 4096  # the default
    assert resolve_max_model_len(None, NS(), default=100) == 100
    assert resolve_max_model_len(123456, NS()) == 123456  # nothing to check against


@pytest.mark.parametrize("value, allowed", [
    (None, False), ("", False), ("0", False), ("no", False), ("1", True), ("true", True),
    ("True", True), (" YES ", True), ("yes", True),
])
def test_long_allowed_by_the_environment(monkeypatch, value, allowed) -> None:
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    assert long_allowed(False) is allowed
    assert long_allowed(True) is True


def test_the_refusal_and_the_warning(monkeypatch, caplog) -> None:
    monkeypatch.delenv(ENV, raising=False)
    cfg = NS(max_position_embeddings=4096)
    msg = ("max_model_len 4097 is longer than the model supports: 4096 positions "
           "(max_position_embeddings with rope scaling, from config.json); past them the "
           "output is garbage. Lower max_model_len, or pass --allow-long-max-model-len (or set "
           "PAGEFOLD_ALLOW_LONG_MAX_MODEL_LEN=1) if you know better")
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        resolve_max_model_len(4097, cfg)
    assert resolve_max_model_len(4096, cfg) == 4096
    with caplog.at_level(logging.WARNING, logger="pagefold"):
        assert resolve_max_model_len(5000, cfg, allow_long=True) == 5000
    assert [r.getMessage() for r in caplog.records] == [
        "max_model_len 5000 exceeds the model's 4096 positions (allowed explicitly): outputs "
        "past 4096 may be wrong"]
