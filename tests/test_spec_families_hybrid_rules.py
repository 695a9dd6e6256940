"""``core/spec_families.py``'s hybrid and linear-attention readers (Falcon-H1, Zamba2, Jamba,
Mamba-1, MiniMax, Kimi Linear) on ``config.json`` dicts, every figure worked out by hand from
the module docstring and the transformers config classes (which field means what, what is
derived from what): per-layer kinds, state shapes and splits per TP size, the defaults when a
field is absent and the exact errors (written for mutmut's survivors, see docs/TESTING.md;
the attention-only and Mamba-2 readers are in ``test_spec_families_rules.py``)."""

from __future__ import annotations

import re

import pytest
import torch

from pagefold.core.kv_cache_spec import FullAttentionSpec, TPSplit
from pagefold.core.spec_from_config import layer_specs_from_config

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def _specs(cfg, **kw):
    return layer_specs_from_config(cfg, model_dtype=BF16, **kw)


def _raises(msg: str):
    return pytest.raises(ValueError, match=f"^{re.escape(msg)}$")


def _unknown(i: int, family: str, value: object, allowed: str) -> str:
    return (f"layer {i} of this {family} config has unknown layer type {value!r}; "
            f"supported layer types: {allowed}")


def _state(spec) -> tuple:
    """A state spec with everything equality leaves out (the splits) and the shape types."""
    return (spec.kind, tuple((c.name, c.shape, c.dtype, c.split, {type(n) for n in c.shape})
                             for c in spec.components))


def _attn(spec) -> tuple:
    return (type(spec).__name__, spec.num_kv_heads, type(spec.num_kv_heads), spec.head_dim,
            type(spec.head_dim), spec.dtype, spec.split)


# ---- Falcon-H1: a Mamba-2 state and an attention cache in every layer ------------------------

FH1 = {"model_type": "falcon_h1", "num_hidden_layers": 2, "hidden_size": 64,
       "mamba_expand": 2, "mamba_d_ssm": 256, "mamba_n_heads": 8, "mamba_n_groups": 2,
       "mamba_d_state": 16, "mamba_d_conv": 4, "num_attention_heads": 8,
       "num_key_value_heads": 4, "head_dim": 16}


def test_falcon_h1_reader_by_hand() -> None:
    specs = _specs(FH1, tensor_parallel_size=2, num_speculative_tokens=1,
                   kv_cache_dtype="float16")
    assert sorted(specs) == ["layers.0", "layers.0.mamba", "layers.1", "layers.1.mamba"]
    assert specs["layers.0"] is specs["layers.1"]
    assert specs["layers.0.mamba"] is specs["layers.1.mamba"]
    # Attention: 4 KV heads over 2 ranks, the config's head_dim, the KV dtype.
    assert _attn(specs["layers.0"]) == ("FullAttentionSpec", 2, int, 16, int, F16,
                                        TPSplit(2, ((4, 1),)))
    # Mamba-2: head_dim "auto" = d_ssm 256 // 8 heads = 32 (not expand * hidden = 128: an
    # explicit d_ssm wins); conv_dim 8 * 32 + 2 * 2 * 16 = 320 -> 160 a rank, 4 - 1 + 1 rows,
    # in the model dtype; ssm (8 / 2, 32, 16) in the model dtype (no SSM dtype named).
    assert _state(specs["layers.0.mamba"]) == ("mamba2", (
        ("conv", (160, 4), BF16, TPSplit(0, ((256, 1), (32, 16), (32, 16))), {int}),
        ("ssm", (4, 32, 16), BF16, TPSplit(0, ((8, 1),)), {int})))


@pytest.mark.parametrize("extra, conv, ssm", [
    # d_ssm null: the intermediate size is mamba_expand * hidden_size = 128, head_dim 16.
    ({"mamba_d_ssm": None}, (8 * 16 + 2 * 2 * 16, 3), (8, 16, 16)),
    # "auto" spelt out: d_ssm 256 // 8 = 32.
    ({"mamba_d_head": "auto"}, (8 * 32 + 64, 3), (8, 32, 16)),
    # An explicit head size (with d_ssm null it still agrees: 4 heads x 32 = 2 x 64).
    ({"mamba_d_ssm": None, "mamba_n_heads": 4, "mamba_d_head": 32}, (4 * 32 + 64, 3),
     (4, 32, 16)),
    # One group is replicated: B and C of one group on every rank.
    ({"mamba_n_groups": 1}, (8 * 32 + 2 * 16, 3), (8, 32, 16)),
])
def test_falcon_h1_mamba_fields(extra, conv, ssm) -> None:
    c, s = _specs(FH1 | extra)["layers.1.mamba"].components
    assert (c.shape, s.shape) == (conv, ssm)


def test_falcon_h1_explicit_head_size() -> None:
    # mamba_d_ssm absent (transformers' default 1024 = 8 heads x 128) and mamba_d_head 128: the
    # model's head size is the explicit one, not expand * hidden // heads = 16.
    cfg = {k: v for k, v in FH1.items() if k != "mamba_d_ssm"} | {"mamba_d_head": 128}
    conv, ssm = _specs(cfg)["layers.0.mamba"].components
    assert (conv.shape, ssm.shape) == ((8 * 128 + 2 * 2 * 16, 3), (8, 128, 16))


def test_falcon_h1_dtypes_and_errors() -> None:
    specs = _specs(FH1, mamba_ssm_cache_dtype="float32", kv_cache_dtype="float16")
    conv, ssm = specs["layers.0.mamba"].components
    assert (conv.dtype, ssm.dtype, specs["layers.0"].dtype) == (BF16, F32, F16)
    assert _specs(FH1 | {"mamba_ssm_dtype": "float16"})["layers.0.mamba"].components[
        1].dtype is F16
    mha = {k: v for k, v in FH1.items() if k != "num_key_value_heads"}
    assert _specs(mha, tensor_parallel_size=2)["layers.0"] == FullAttentionSpec(4, 16, BF16)
    with _raises("Mamba-2 n_groups (2) must be 1 or divisible by tensor_parallel_size 4"):
        _specs(FH1, tensor_parallel_size=4)
    with _raises("the model config has no 'mamba_n_heads', needed to size its cache"):
        _specs({k: v for k, v in FH1.items() if k != "mamba_n_heads"})
    with _raises("the model config has no 'mamba_expand', needed to size its cache"):
        _specs({k: v for k, v in FH1.items() if k != "mamba_expand"} | {"mamba_d_ssm": None})
