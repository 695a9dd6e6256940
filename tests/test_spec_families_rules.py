"""``core/spec_families.py``'s shared pieces and its attention-only and Mamba-2 readers on
``config.json`` dicts, every figure worked out by hand from the module docstring and the
transformers defaults it names: layer-type defaults (Gemma 3, gpt-oss, LFM2), the exact
unknown-type errors, per-rank attention heads, the Mamba-2 state and its SSM dtype precedence
(written for mutmut's survivors; the other families are in
``test_spec_families_hybrid_rules.py``, see docs/TESTING.md)."""

from __future__ import annotations

import re

import pytest
import torch

from pagefold.core.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
    StateComponent,
    StateSpec,
    TPSplit,
)
from pagefold.core.spec_families import (
    gemma3_layer_types,
    gpt_oss_layer_types,
    lfm2_layer_types,
    llama4_layer_types,
)
from pagefold.core.spec_from_config import layer_specs_from_config

BF16, F32 = torch.bfloat16, torch.float32
S, F = "sliding_attention", "full_attention"


def _specs(cfg, **kw):
    return layer_specs_from_config(cfg, model_dtype=BF16, **kw)


def _raises(msg: str):
    return pytest.raises(ValueError, match=f"^{re.escape(msg)}$")


def _unknown(i: int, family: str, value: str, allowed: str) -> str:
    return (f"layer {i} of this {family} config has unknown layer type {value!r}; "
            f"supported layer types: {allowed}")


def test_layer_type_defaults() -> None:
    # Gemma 3: every 6th layer full by default, else every sliding_window_pattern-th.
    assert gemma3_layer_types({"num_hidden_layers": 7}) == [S, S, S, S, S, F, S]
    assert gemma3_layer_types({"num_hidden_layers": 4, "sliding_window_pattern": 2}) == [
        S, F, S, F]
    assert gemma3_layer_types({"num_hidden_layers": 9, "layer_types": (F, S)}) == [F, S]
    # gpt-oss: even layers sliding, odd layers full.
    assert gpt_oss_layer_types({"num_hidden_layers": 5}) == [S, F, S, F, S]
    assert gpt_oss_layer_types({"num_hidden_layers": 9, "layer_types": (F, F)}) == [F, F]
    # LFM2: attention at full_attn_idxs, else all attention.
    assert lfm2_layer_types({"num_hidden_layers": 4, "full_attn_idxs": [1, 3]}) == [
        "conv", F, "conv", F]
    assert lfm2_layer_types({"num_hidden_layers": 3}) == [F, F, F]
    assert lfm2_layer_types({"num_hidden_layers": 9, "layer_types": ("conv", F)}) == [
        "conv", F]
    with _raises(_unknown(1, "LFM2", "mamba", "conv, full_attention")):
        lfm2_layer_types({"layer_types": ["conv", "mamba"]})


GPT_OSS = {"model_type": "gpt_oss", "num_hidden_layers": 4, "sliding_window": 128,
           "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}


def test_sliding_or_full_readers() -> None:
    specs = _specs(GPT_OSS, tensor_parallel_size=2, kv_cache_dtype="float16")
    full = FullAttentionSpec(2, 64, torch.float16)
    swa = SlidingWindowSpec(2, 64, torch.float16, 128)
    assert specs == {"layers.0": swa, "layers.1": full, "layers.2": swa, "layers.3": full}
    assert specs["layers.1"] is specs["layers.3"]
    assert specs["layers.0"].split == specs["layers.1"].split == TPSplit(2, ((4, 1),))
    assert {type(n) for s in specs.values() for n in (s.num_kv_heads, s.head_dim)} == {int}
    assert _specs(GPT_OSS, tensor_parallel_size=8)["layers.1"].num_kv_heads == 1
    mha = {k: v for k, v in GPT_OSS.items() if k != "num_key_value_heads"}
    assert _specs(mha)["layers.1"] == FullAttentionSpec(8, 64, BF16)
    with _raises(_unknown(1, "gpt-oss", "bogus", "full_attention, sliding_attention")):
        _specs(GPT_OSS | {"layer_types": [S, "bogus"]})
    g3 = {"model_type": "gemma3_text", "num_hidden_layers": 2, "sliding_window": 32,
          "sliding_window_pattern": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16}
    assert _specs(g3) == {"layers.0": SlidingWindowSpec(2, 16, BF16, 32),
                          "layers.1": FullAttentionSpec(2, 16, BF16)}
    with _raises(_unknown(0, "Gemma-3", "bogus", "full_attention, sliding_attention")):
        _specs(g3 | {"layer_types": ["bogus", F]})


M2 = {"model_type": "mamba2", "num_hidden_layers": 3, "num_heads": 8, "head_dim": 16,
      "n_groups": 1, "state_size": 16, "conv_kernel": 4}


def test_mamba2_state_by_hand() -> None:
    specs = _specs(M2, num_speculative_tokens=2)
    assert sorted(specs) == ["layers.0", "layers.1", "layers.2"]
    st = specs["layers.0"]
    assert st is specs["layers.2"] and st.kind == "mamba2"
    conv, ssm = st.components
    # conv_dim 8 * 16 + 2 * 1 * 16 = 160; 3 + 2 rows; ssm (heads, head_dim, state).
    assert (conv.name, conv.shape, conv.dtype) == ("conv", (160, 5), BF16)
    assert (ssm.name, ssm.shape, ssm.dtype) == ("ssm", (8, 16, 16), BF16)
    assert conv.split == TPSplit(0, ((128, 1), (16, 16), (16, 16)))
    assert ssm.split == TPSplit(0, ((8, 1),))
    # One group over 2 ranks is replicated: 128 + 2 * 2 * 16 = 192 -> 96 a rank; B/C blocks
    # keep the full width of one group.
    c2, s2 = _specs(M2, tensor_parallel_size=2)["layers.0"].components
    assert (c2.shape, s2.shape) == ((96, 3), (4, 16, 16))
    assert c2.split == TPSplit(0, ((128, 1), (16, 16), (16, 16)))
    c4, s4 = _specs(M2 | {"n_groups": 4}, tensor_parallel_size=2)["layers.0"].components
    assert (c4.shape, s4.shape) == ((128, 3), (4, 16, 16))  # (128 + 128) / 2
    assert c4.split == TPSplit(0, ((128, 1), (64, 16), (64, 16)))
    assert {type(n) for c in (c2, s2, c4, s4) for n in c.shape} == {int}
    with _raises("Mamba-2 n_groups (3) must be 1 or divisible by tensor_parallel_size 2"):
        _specs(M2 | {"n_groups": 3}, tensor_parallel_size=2)
    with _raises("Mamba-2 conv_dim (67) is not divisible by tensor_parallel_size 2"):
        _specs(M2 | {"num_heads": 3, "head_dim": 1, "n_groups": 2}, tensor_parallel_size=2)
    with _raises("Mamba-2 heads (6) is not divisible by tensor_parallel_size 4"):
        _specs(M2 | {"num_heads": 6, "head_dim": 2, "n_groups": 4}, tensor_parallel_size=4)


@pytest.mark.parametrize("extra, override, want", [
    ({}, None, BF16),
    ({"mamba_ssm_dtype": "float32"}, None, F32),
    ({"mamba_ssm_cache_dtype": "float16"}, None, torch.float16),
    ({"mamba_ssm_dtype": "auto"}, None, BF16),
    ({"mamba_ssm_dtype": "float32"}, "float16", torch.float16),
    ({"mamba_ssm_dtype": "float32"}, "auto", F32),
])
def test_mamba2_ssm_dtype(extra, override, want) -> None:
    conv, ssm = _specs(M2 | extra, mamba_ssm_cache_dtype=override)["layers.0"].components
    assert ssm.dtype is want and conv.dtype is BF16


def test_mamba2_ssm_dtype_errors() -> None:
    names = "float32, float, bfloat16, float16, half"
    with _raises(f"mamba_ssm_cache_dtype must be one of {names}; got 'fp8'"):
        _specs(M2, mamba_ssm_cache_dtype="fp8")
    with _raises(f"the config's mamba_ssm_dtype must be one of {names}; got 'fp8'"):
        _specs(M2 | {"mamba_ssm_dtype": "fp8"})


C = "chunked_attention"


def test_llama4_layers_by_hand() -> None:
    # RoPE layers (all but every no_rope_layer_interval-th, 4 by default) are chunked when
    # attention_chunk_size is set.
    assert llama4_layer_types({"num_hidden_layers": 5, "attention_chunk_size": 8}) == [
        C, C, C, F, C]
    assert llama4_layer_types({"num_hidden_layers": 5, "attention_chunk_size": 8,
                               "no_rope_layer_interval": 2}) == [C, F, C, F, C]
    assert llama4_layer_types({"num_hidden_layers": 3}) == [F, F, F]
    assert llama4_layer_types({"num_hidden_layers": 2, "attention_chunk_size": 8,
                               "no_rope_layers": [0, 1, 1]}) == [F, C]
    assert llama4_layer_types({"num_hidden_layers": 4, "attention_chunk_size": 8,
                               "no_rope_layers": []}) == [C, C, C, F]
    assert llama4_layer_types({"num_hidden_layers": 9, "layer_types": (F, C)}) == [F, C]
    with _raises(_unknown(1, "Llama-4", S, "chunked_attention, full_attention")):
        llama4_layer_types({"layer_types": [C, S]})
    cfg = {"model_type": "llama4_text", "num_hidden_layers": 4, "attention_chunk_size": 8,
           "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16}
    specs = _specs(cfg, tensor_parallel_size=2, kv_cache_dtype="float16")
    chunked = ChunkedLocalAttentionSpec(2, 16, torch.float16, 8)
    assert specs == {"layers.0": chunked, "layers.1": chunked, "layers.2": chunked,
                     "layers.3": FullAttentionSpec(2, 16, torch.float16)}
    assert specs["layers.0"].split == specs["layers.3"].split == TPSplit(2, ((4, 1),))


LFM2 = {"model_type": "lfm2", "num_hidden_layers": 4, "full_attn_idxs": [1, 3],
        "hidden_size": 64, "conv_L_cache": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2}


def test_lfm2_reader_by_hand() -> None:
    specs = _specs(LFM2, tensor_parallel_size=2, num_speculative_tokens=1,
                   kv_cache_dtype="float32")
    # Attention: 2 KV heads over 2 ranks, head_dim 64 // 4; short conv: 64 / 2 channels,
    # L_cache - 1 + 1 draft rows, in the model dtype.
    attn = FullAttentionSpec(1, 16, F32)
    conv = StateSpec("shortconv", (StateComponent("conv", (32, 3), BF16),))
    assert specs == {"layers.0": conv, "layers.1": attn, "layers.2": conv, "layers.3": attn}
    assert specs["layers.1"].split == TPSplit(2, ((2, 1),))
    assert specs["layers.0"].components[0].split == TPSplit(0, ((64, 1),))
    assert {type(n) for n in (specs["layers.1"].num_kv_heads, specs["layers.1"].head_dim,
                              *specs["layers.0"].components[0].shape)} == {int}
    four = _specs(LFM2 | {"num_key_value_heads": 4}, tensor_parallel_size=2)["layers.1"]
    assert four.num_kv_heads == 2 and type(four.num_kv_heads) is int  # 4 // 2, not 2.0
    one = _specs(LFM2)
    assert one["layers.1"] == FullAttentionSpec(2, 16, BF16)
    assert one["layers.0"].components[0].shape == (64, 2)
    mha = {k: v for k, v in LFM2.items() if k != "num_key_value_heads"}
    assert _specs(mha)["layers.1"] == FullAttentionSpec(4, 16, BF16)
    with _raises("LFM2 hidden_size (64) is not divisible by tensor_parallel_size 3"):
        _specs(LFM2, tensor_parallel_size=3)
