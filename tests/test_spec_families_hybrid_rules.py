"""``core/spec_families.py``'s hybrid and linear-attention readers (Falcon-H1, Zamba2, Jamba,
Mamba-1, MiniMax, Kimi Linear) on ``config.json`` dicts, every figure worked out by hand from
the module docstring and the transformers config classes (which field means what, what is
derived from what): per-layer kinds, state shapes and splits per TP size, the defaults when a
field is absent and the exact errors (written for mutmut's survivors, see docs/TESTING.md;
the attention-only and Mamba-2 readers are in ``test_spec_families_rules.py``)."""

from __future__ import annotations

import pytest
import torch

from pagefold.core.kv_cache_spec import FullAttentionSpec, TPSplit
from pagefold.core.spec_families import (
    jamba_layer_kinds,
    kimi_layer_types,
    mamba1_state,
    minimax_layer_types,
    zamba2_hybrid_layers,
)
from tests.test_spec_families_rules import BF16, F32, F, S, _raises, _specs, _unknown

F16 = torch.float16


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


def test_falcon_h1_d_ssm_absent_is_transformers_default() -> None:
    # No mamba_d_ssm and head size "auto": FalconH1Config's default d_ssm 1024 gives a head
    # size of 1024 // 8 = 128 (not expand 2 * hidden 64 // 8 = 16); transformers' own config
    # object built from the same dict agrees.
    from transformers import FalconH1Config

    cfg = {k: v for k, v in FH1.items() if k != "mamba_d_ssm"}
    want = ((8 * 128 + 2 * 2 * 16, 3), (8, 128, 16))
    conv, ssm = _specs(cfg)["layers.0.mamba"].components
    assert (conv.shape, ssm.shape) == want
    hf = FalconH1Config(**cfg)
    assert (hf.mamba_d_ssm, hf.mamba_d_head) == (1024, 128)


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


# ---- Zamba2: a Mamba-2 state in every layer, a KV cache per use of the shared block ----------

Z2 = {"model_type": "zamba2", "num_hidden_layers": 4, "hidden_size": 64, "mamba_expand": 2,
      "n_mamba_heads": 4, "mamba_ngroups": 1, "mamba_d_state": 16, "mamba_d_conv": 4,
      "num_attention_heads": 8, "num_key_value_heads": 4,
      "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"]}


def test_zamba2_hybrid_layers() -> None:
    types = ["mamba", "hybrid", "mamba2", "g", "m", "linear_attention", "hybrid"]
    assert zamba2_hybrid_layers({"layers_block_type": types}) == [1, 3, 6]
    assert zamba2_hybrid_layers({"layer_types": ["g", "m"]}) == [0]
    assert zamba2_hybrid_layers({"layers_block_type": ["m"], "layer_types": ["g"]}) == []
    allowed = "mamba, mamba2, linear_attention, m, hybrid, g"
    with _raises(_unknown(2, "Zamba2", "attention", allowed)):
        zamba2_hybrid_layers({"layers_block_type": ["m", "g", "attention"]})
    with _raises("the model config has no 'layers_block_type' (or 'layer_types'), needed to "
                 "size its cache"):
        zamba2_hybrid_layers({})


def test_zamba2_reader_by_hand() -> None:
    specs = _specs(Z2, tensor_parallel_size=2, num_speculative_tokens=2,
                   kv_cache_dtype="float16", mamba_ssm_cache_dtype="float32")
    assert sorted(specs) == ["layers.0", "layers.1", "layers.1.attn", "layers.2", "layers.3",
                             "layers.3.attn"]
    assert len({id(specs[f"layers.{i}"]) for i in range(4)}) == 1
    assert specs["layers.1.attn"] is specs["layers.3.attn"]
    # Mamba-2: I = 2 * 64 = 128, head_dim 128 // 4 = 32; one group replicated over 2 ranks:
    # conv_dim 128 + 2 * 2 * 16 = 192 -> 96, 4 - 1 + 2 rows (model dtype); ssm (2, 32, 16).
    assert _state(specs["layers.0"]) == ("mamba2", (
        ("conv", (96, 5), BF16, TPSplit(0, ((128, 1), (16, 16), (16, 16))), {int}),
        ("ssm", (2, 32, 16), F32, TPSplit(0, ((4, 1),)), {int})))
    # The shared block attends over the concatenated embeddings: head_dim 2 * 64 // 8 = 16.
    assert _attn(specs["layers.1.attn"]) == ("FullAttentionSpec", 2, int, 16, int, F16,
                                             TPSplit(2, ((4, 1),)))


def test_zamba2_heads_defaults_and_errors() -> None:
    # 8 ranks: 4 KV heads replicated (one a rank); the Mamba-2 part still divides
    # (I 128 / 8 heads = 16; conv_dim 128 + 2 * 8 * 16 = 384 -> 48).
    specs = _specs(Z2 | {"n_mamba_heads": 8}, tensor_parallel_size=8)
    assert specs["layers.1.attn"] == FullAttentionSpec(1, 16, BF16)
    conv, ssm = specs["layers.0"].components
    assert (conv.shape, ssm.shape, ssm.dtype) == ((48, 3), (1, 16, 16), BF16)
    named = _specs(Z2 | {"mamba_ssm_dtype": "float32"})["layers.2"].components
    assert (named[0].dtype, named[1].dtype) == (BF16, F32)
    mha = {k: v for k, v in Z2.items() if k != "num_key_value_heads"}
    assert _specs(mha, tensor_parallel_size=2)["layers.3.attn"] == FullAttentionSpec(4, 16, BF16)
    with _raises("Mamba-2 heads (4) is not divisible by tensor_parallel_size 8"):
        _specs(Z2, tensor_parallel_size=8)
    with _raises("the model config has no 'mamba_ngroups', needed to size its cache"):
        _specs({k: v for k, v in Z2.items() if k != "mamba_ngroups"})


# ---- Jamba: Mamba-1 or attention per layer (attn_layer_period / offset) -----------------------

JAMBA = {"model_type": "jamba", "num_hidden_layers": 6, "hidden_size": 64, "mamba_expand": 2,
         "mamba_d_state": 16, "mamba_d_conv": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "attn_layer_period": 4, "attn_layer_offset": 1,
         "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 4}
A, M = "attention", "mamba"


def test_jamba_layer_kinds() -> None:
    # attention where i % 4 == 1; MoE where i % 2 == 1 (more than one expert).
    assert jamba_layer_kinds(JAMBA) == [(M, False), (A, True), (M, False), (M, True),
                                        (M, False), (A, True)]
    no_moe = {k: v for k, v in JAMBA.items() if k != "num_experts"}
    assert jamba_layer_kinds(no_moe) == [(M, False), (A, False), (M, False), (M, False),
                                         (M, False), (A, False)]
    assert jamba_layer_kinds(no_moe | {"num_local_experts": 2}) == jamba_layer_kinds(JAMBA)
    assert jamba_layer_kinds(JAMBA | {"num_experts": 1})[1] == (A, False)
    assert jamba_layer_kinds(JAMBA | {"attn_layer_period": 3, "attn_layer_offset": 2,
                                      "expert_layer_period": 3, "expert_layer_offset": 0}) == [
        (M, True), (M, False), (A, False), (M, True), (M, False), (A, False)]
    for field in ("attn_layer_period", "attn_layer_offset", "expert_layer_period",
                  "expert_layer_offset"):
        with _raises(f"the model config has no {field!r}, needed to size its cache"):
            jamba_layer_kinds({k: v for k, v in JAMBA.items() if k != field})


def test_mamba1_state_by_hand() -> None:
    st = mamba1_state(inter=128, state=16, kernel=4, tp=2, num_spec=2, conv_dtype=BF16,
                      ssm_dtype=F32)
    cut = TPSplit(0, ((128, 1),))
    assert _state(st) == ("mamba1", (("conv", (64, 5), BF16, cut, {int}),
                                     ("ssm", (64, 16), F32, cut, {int})))
    with _raises("Mamba-1 intermediate size (128) is not divisible by tensor_parallel_size 3"):
        mamba1_state(inter=128, state=16, kernel=4, tp=3, num_spec=0, conv_dtype=BF16,
                     ssm_dtype=F32)


def test_jamba_reader_by_hand() -> None:
    specs = _specs(JAMBA, tensor_parallel_size=2, num_speculative_tokens=1,
                   kv_cache_dtype="float16", mamba_ssm_cache_dtype="float32")
    assert sorted(specs) == [f"layers.{i}" for i in range(6)]
    attn, st = specs["layers.1"], specs["layers.0"]
    assert specs["layers.5"] is attn and all(specs[f"layers.{i}"] is st for i in (2, 3, 4))
    # Attention: 2 KV heads over 2 ranks, head_dim 64 // 4 (no head_dim in Jamba's config).
    assert _attn(attn) == ("FullAttentionSpec", 1, int, 16, int, F16, TPSplit(2, ((2, 1),)))
    # Mamba-1: I = 2 * 64 = 128 -> 64 a rank; conv 4 - 1 + 1 rows; ssm (64, d_state 16).
    cut = TPSplit(0, ((128, 1),))
    assert _state(st) == ("mamba1", (("conv", (64, 4), BF16, cut, {int}),
                                     ("ssm", (64, 16), F32, cut, {int})))
    one = _specs(JAMBA | {"mamba_ssm_dtype": "float16"})
    assert one["layers.0"].components[1].dtype is F16
    assert one["layers.0"].components[0].shape == (128, 3)
    assert one["layers.1"] == FullAttentionSpec(2, 16, BF16)
    assert _specs(JAMBA)["layers.2"].components[1].dtype is BF16  # no SSM dtype named


# ---- Mamba / Falcon-Mamba: a Mamba-1 state in every layer ------------------------------------

MAMBA = {"model_type": "mamba", "num_hidden_layers": 3, "hidden_size": 64, "expand": 2,
         "state_size": 16, "conv_kernel": 4}


def test_mamba1_reader_by_hand() -> None:
    specs = _specs(MAMBA, tensor_parallel_size=2, num_speculative_tokens=3,
                   mamba_ssm_cache_dtype="float32")
    assert sorted(specs) == ["layers.0", "layers.1", "layers.2"]
    st = specs["layers.0"]
    assert specs["layers.1"] is st and specs["layers.2"] is st
    cut = TPSplit(0, ((128, 1),))  # I = 2 * 64
    assert _state(st) == ("mamba1", (("conv", (64, 6), BF16, cut, {int}),
                                     ("ssm", (64, 16), F32, cut, {int})))
    # A fractional expand (transformers: int(expand * hidden_size)): 1.5 * 64 = 96.
    fm = {**MAMBA, "model_type": "falcon_mamba", "expand": 1.5, "num_hidden_layers": 1}
    conv, ssm = _specs(fm)["layers.0"].components
    assert (conv.shape, ssm.shape, ssm.dtype) == ((96, 3), (96, 16), BF16)
    assert _specs(MAMBA | {"mamba_ssm_dtype": "float16"})["layers.2"].components[1].dtype is F16
    with _raises("the model config has no 'state_size', needed to size its cache"):
        _specs({k: v for k, v in MAMBA.items() if k != "state_size"})


# ---- MiniMax: lightning (linear) attention or full attention per layer -----------------------

L = "linear_attention"


def test_minimax_layer_types() -> None:
    assert minimax_layer_types({"num_hidden_layers": 9, "layer_types": (L, F)}) == [L, F]
    # The original checkpoints' attn_type_list: 0 lightning, 1 full.
    assert minimax_layer_types({"num_hidden_layers": 9, "attn_type_list": [0, 1, 1, 0]}) == [
        L, F, F, L]
    # transformers' default: full attention at even layers.
    assert minimax_layer_types({"num_hidden_layers": 5}) == [F, L, F, L, F]
    with _raises(_unknown(1, "MiniMax", S, "linear_attention, full_attention")):
        minimax_layer_types({"layer_types": [F, S]})
    with _raises(_unknown(0, "MiniMax", "conv", "linear_attention, full_attention")):
        minimax_layer_types({"layer_types": ["conv"]})


MINIMAX = {"model_type": "minimax", "num_hidden_layers": 4, "hidden_size": 64,
           "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
           "layer_types": [L, F, L, L]}


def test_minimax_reader_by_hand() -> None:
    specs = _specs(MINIMAX, tensor_parallel_size=2, kv_cache_dtype="float16",
                   num_speculative_tokens=2)
    assert sorted(specs) == [f"layers.{i}" for i in range(4)]
    lightning = specs["layers.0"]
    assert specs["layers.2"] is lightning and specs["layers.3"] is lightning
    # The lightning state: one (head_dim x head_dim) matrix per head, 8 heads / 2 ranks, in the
    # SSM dtype (the model dtype when none is named); no conv, so no draft rows.
    assert _state(lightning) == ("lightning", (
        ("kv", (4, 16, 16), BF16, TPSplit(0, ((8, 1),)), {int}),))
    assert _attn(specs["layers.1"]) == ("FullAttentionSpec", 1, int, 16, int, F16,
                                        TPSplit(2, ((2, 1),)))
    # No head_dim: hidden_size // num_attention_heads = 8, for both caches.
    no_hd = {k: v for k, v in MINIMAX.items() if k != "head_dim"}
    one = _specs(no_hd | {"mamba_ssm_dtype": "float32"})
    assert one["layers.0"].components[0].shape == (8, 8, 8)
    assert one["layers.0"].components[0].dtype is F32
    assert one["layers.1"] == FullAttentionSpec(2, 8, BF16)
    over = _specs(MINIMAX, mamba_ssm_cache_dtype="float16")["layers.3"].components[0]
    assert over.dtype is F16
    with _raises("MiniMax heads (8) is not divisible by tensor_parallel_size 3"):
        _specs(MINIMAX, tensor_parallel_size=3)


# ---- Kimi Linear: KDA (conv + ssm) or MLA per layer -------------------------------------------

KIMI = {"model_type": "kimi_linear", "num_hidden_layers": 4, "hidden_size": 64,
        "kv_lora_rank": 32, "qk_rope_head_dim": 8,
        "linear_attn_config": {"num_heads": 4, "head_dim": 8, "short_conv_kernel_size": 4,
                               "full_attn_layers": [2], "kda_layers": [1, 3, 4]}}


def test_kimi_layer_types() -> None:
    # 1-indexed full_attn_layers / kda_layers.
    assert kimi_layer_types(KIMI) == [L, F, L, L]
    assert kimi_layer_types(KIMI | {"layer_types": (F, L)}) == [F, L]
    # Without both lists: transformers' default, MLA at layers 4, 8, ... (0-indexed).
    assert kimi_layer_types({"num_hidden_layers": 9}) == [L, L, L, L, F, L, L, L, F]
    only_full = {"num_hidden_layers": 5, "linear_attn_config": {"full_attn_layers": [1]}}
    assert kimi_layer_types(only_full) == [L, L, L, L, F]
    only_kda = {"num_hidden_layers": 5, "linear_attn_config": {"kda_layers": [5]}}
    assert kimi_layer_types(only_kda) == [L, L, L, L, F]
    # A layer neither list names has no type.
    gap = {"num_hidden_layers": 3,
           "linear_attn_config": {"full_attn_layers": [1], "kda_layers": [2]}}
    with _raises(_unknown(2, "Kimi Linear", None, "linear_attention, full_attention")):
        kimi_layer_types(gap)
    with _raises(_unknown(1, "Kimi Linear", S, "linear_attention, full_attention")):
        kimi_layer_types({"num_hidden_layers": 2, "layer_types": [L, S]})


def test_kimi_linear_reader_by_hand() -> None:
    specs = _specs(KIMI, tensor_parallel_size=2, num_speculative_tokens=1,
                   kv_cache_dtype="float16")
    assert sorted(specs) == [f"layers.{i}" for i in range(4)]
    kda, mla = specs["layers.0"], specs["layers.1"]
    assert specs["layers.2"] is kda and specs["layers.3"] is kda
    # KDA: q, k and v conv channels 3 * (4 / 2) * 8 = 48 a rank, 4 - 1 + 1 rows, model dtype;
    # ssm (4 / 2, 8, 8) in float32 (transformers keeps the recurrent state in float32).
    qkv = (32, 8)
    assert _state(kda) == ("kda", (
        ("conv", (48, 4), BF16, TPSplit(0, (qkv, qkv, qkv)), {int}),
        ("ssm", (2, 8, 8), F32, TPSplit(0, ((4, 1),)), {int})))
    # MLA: one latent row of kv_lora_rank + qk_rope_head_dim = 40, whole on every rank.
    assert (type(mla).__name__, mla.latent_dim, mla.dtype, mla.split) == (
        "MLASpec", 40, F16, TPSplit(1, ((40, 40),)))
    with _raises("KDA heads (4) is not divisible by tensor_parallel_size 3"):
        _specs(KIMI, tensor_parallel_size=3)


@pytest.mark.parametrize("override, named, want", [
    (None, None, F32), ("auto", None, F32), (None, "float16", F32), ("auto", "float16", F32),
    ("bfloat16", None, BF16), ("float16", "bfloat16", F16),
])
def test_kimi_linear_ssm_dtype(override, named, want) -> None:
    cfg = KIMI if named is None else KIMI | {"mamba_ssm_dtype": named}
    conv, ssm = _specs(cfg, mamba_ssm_cache_dtype=override)["layers.0"].components
    assert (conv.dtype, ssm.dtype) == (BF16, want)


def test_kimi_linear_field_fallbacks() -> None:
    # Top-level linear_* fields when linear_attn_config lacks them; theirs win otherwise.
    top = {"model_type": "kimi_linear", "num_hidden_layers": 1, "kv_lora_rank": 4,
           "qk_rope_head_dim": 4, "linear_num_heads": 2, "linear_head_dim": 4,
           "linear_conv_kernel_dim": 3}
    conv, ssm = _specs(top)["layers.0"].components
    assert (conv.shape, ssm.shape) == ((3 * 2 * 4, 2), (2, 4, 4))
    sub = top | {"linear_attn_config": {"num_heads": 1, "head_dim": 2,
                                        "short_conv_kernel_size": 5}}
    conv, ssm = _specs(sub)["layers.0"].components
    assert (conv.shape, ssm.shape) == ((3 * 1 * 2, 4), (1, 2, 2))
    assert conv.split == TPSplit(0, ((2, 2),) * 3)
    # Neither: transformers' defaults, 32 heads of 128, kernel 4.
    bare = {"model_type": "kimi_linear", "num_hidden_layers": 1, "kv_lora_rank": 4,
            "qk_rope_head_dim": 4}
    conv, ssm = _specs(bare)["layers.0"].components
    assert (conv.shape, ssm.shape) == ((3 * 32 * 128, 3), (32, 128, 128))
    with _raises("the model config has no 'kv_lora_rank', needed to size its cache"):
        _specs({k: v for k, v in KIMI.items() if k != "kv_lora_rank"})
