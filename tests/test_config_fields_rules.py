"""``core/config_fields.py``'s readers on plain ``config.json`` dicts and attribute configs,
each expected value written by hand from the module's docstrings: dtype spellings and the
exact error, tensor-parallel splits, the nested text config, the model dtype's precedence and
the head-size fallbacks (written for mutmut's survivors)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from pagefold.core.config_fields import (
    config_head_dim,
    config_model_dtype,
    parse_dtype,
    split_for_tp,
    unwrap_text_config,
)


@pytest.mark.parametrize("value, want", [
    ("float32", torch.float32), ("float", torch.float32), ("torch.float32", torch.float32),
    ("bfloat16", torch.bfloat16), ("torch.bfloat16", torch.bfloat16),
    ("float16", torch.float16), ("half", torch.float16), ("torch.half", torch.float16),
    (torch.float64, torch.float64),  # a dtype passes through, even one not named
])
def test_parse_dtype(value, want) -> None:
    assert parse_dtype(value, "x") is want


@pytest.mark.parametrize("value", ["fp8", "torch.int8", "Float32", "auto"])
def test_parse_dtype_error(value) -> None:
    msg = (f"the config's mamba_ssm_dtype must be one of float32, float, bfloat16, float16, "
           f"half; got {value!r}")
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        parse_dtype(value, "the config's mamba_ssm_dtype")


def test_split_for_tp() -> None:
    parts = [split_for_tp(16, tp, "heads") for tp in (1, 2, 4, 8, 16)]
    assert parts == [16, 8, 4, 2, 1]
    assert {type(p) for p in parts} == {int}  # a shape, never 8.0
    msg = "num_kv_heads (6) is not divisible by tensor_parallel_size 4"
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        split_for_tp(6, 4, "num_kv_heads")


def test_unwrap_text_config() -> None:
    inner = {"model_type": "qwen3_5_text"}
    assert unwrap_text_config({"model_type": "qwen3_5", "text_config": inner}) is inner
    top = {"model_type": "llama", "text_config": None}
    assert unwrap_text_config(top) is top
    obj = SimpleNamespace(text_config=SimpleNamespace(a=1))
    assert unwrap_text_config(obj) is obj.text_config
    plain = SimpleNamespace(a=1)
    assert unwrap_text_config(plain) is plain


@pytest.mark.parametrize("cfg, want", [
    ({"dtype": "bfloat16"}, "bfloat16"),
    ({"torch_dtype": "torch.float16"}, "float16"),
    ({"dtype": "float32", "torch_dtype": "bfloat16"}, "float32"),  # dtype named first
    ({"dtype": None, "torch_dtype": "bfloat16"}, "bfloat16"),
    ({"dtype": torch.bfloat16}, "bfloat16"),
    # The text config first, the top config when the text config names none.
    ({"dtype": "float32", "text_config": {"dtype": "bfloat16"}}, "bfloat16"),
    ({"torch_dtype": "float16", "text_config": {"model_type": "t"}}, "float16"),
    (SimpleNamespace(torch_dtype="bfloat16"), "bfloat16"),
    ({"model_type": "llama"}, None),
    ({"text_config": {}}, None),
])
def test_config_model_dtype(cfg, want) -> None:
    assert config_model_dtype(cfg) == want


@pytest.mark.parametrize("cfg, want", [
    ({"head_dim": 80, "hidden_size": 4096, "num_attention_heads": 32}, 80),
    ({"head_dim": "96", "model_type": "qwen3"}, 96),
    ({"attention_head_dim": 72, "hidden_size": 64, "num_attention_heads": 1}, 72),
    ({"head_dim": None, "attention_head_dim": 40, "model_type": "qwen3"}, 40),
    # transformers' class defaults for these model types when the config omits head_dim.
    ({"model_type": "qwen3", "hidden_size": 1024, "num_attention_heads": 16}, 128),
    ({"model_type": "qwen3_moe", "hidden_size": 1024, "num_attention_heads": 16}, 128),
    ({"model_type": "qwen3_5_text", "hidden_size": 1024, "num_attention_heads": 16}, 256),
    ({"model_type": "qwen3_5_moe_text", "hidden_size": 1024, "num_attention_heads": 16}, 256),
    ({"model_type": "qwen3_next", "hidden_size": 1024, "num_attention_heads": 16}, 256),
    # The rest: hidden_size // num_attention_heads (floor).
    ({"model_type": "llama", "hidden_size": 1024, "num_attention_heads": 16}, 64),
    ({"hidden_size": 1000, "num_attention_heads": 3}, 333),
    ({"hidden_size": "2048", "num_attention_heads": "8"}, 256),
    (SimpleNamespace(model_type="mistral", head_dim=None, hidden_size=4096,
                     num_attention_heads=32), 128),
])
def test_config_head_dim(cfg, want) -> None:
    assert config_head_dim(cfg) == want


def test_config_head_dim_missing_fields() -> None:
    msg = "the model config has no 'hidden_size', needed to size its cache"
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        config_head_dim({"model_type": "llama", "num_attention_heads": 8})
