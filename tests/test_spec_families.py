"""Config readers of the added families (core/spec_families.py): layer-kind rules from plain
config.json dicts, state shapes, tensor parallelism and clear errors. No models are built."""

from __future__ import annotations

import pytest
import torch

from pagefold.core.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MLASpec,
    SlidingWindowSpec,
    StateSpec,
)
from pagefold.core.spec_from_config import layer_specs_from_config

F32 = torch.float32


def specs(cfg: dict, **kw):
    return layer_specs_from_config(cfg, model_dtype=kw.pop("model_dtype", F32), **kw)


def test_gemma3_pattern_without_layer_types() -> None:
    cfg = dict(model_type="gemma3_text", num_hidden_layers=7, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, hidden_size=64, sliding_window=512,
               sliding_window_pattern=6)
    got = specs(cfg)
    assert [type(got[f"layers.{i}"]) for i in range(7)] == (
        [SlidingWindowSpec] * 5 + [FullAttentionSpec] + [SlidingWindowSpec])
    assert got["layers.0"].window == 512 and got["layers.5"].head_dim == 32


def test_mamba2_state_and_tp() -> None:
    cfg = dict(model_type="mamba2", num_hidden_layers=2, num_heads=8, head_dim=16, n_groups=1,
               state_size=32, conv_kernel=4, hidden_size=64)
    one = specs(cfg)["layers.0"]
    assert isinstance(one, StateSpec) and one.kind == "mamba2"
    assert one.component("conv").shape == (128 + 2 * 32, 3)
    assert one.component("ssm").shape == (8, 16, 32)
    two = specs(cfg, tensor_parallel_size=2)["layers.1"]  # the single group is replicated
    assert two.component("conv").shape == ((128 + 2 * 2 * 32) // 2, 3)
    assert two.component("ssm").shape == (4, 16, 32)


def test_mamba1_states_and_llama4_chunked_layers() -> None:
    """Mamba / Falcon-Mamba: a Mamba-1 state per layer, I = expand * hidden split over the
    ranks. Llama-4 without layer_types: RoPE layers (all but every 4th) are chunked local
    attention, NoPE layers full; no chunk size makes every layer full."""
    mamba = dict(model_type="falcon_mamba", num_hidden_layers=2, hidden_size=48, expand=2,
                 state_size=16, conv_kernel=4)
    one = specs(mamba)["layers.1"]
    assert one.kind == "mamba1" and one.component("conv").shape == (96, 3)
    assert one.component("ssm").shape == (96, 16)
    assert specs(mamba, tensor_parallel_size=2)["layers.0"].component("ssm").shape == (48, 16)
    llama4 = dict(model_type="llama4_text", num_hidden_layers=5, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=16, hidden_size=64, attention_chunk_size=32)
    got = specs(llama4, tensor_parallel_size=2)
    local = ChunkedLocalAttentionSpec(2, 16, F32, 32)
    assert [got[f"layers.{i}"] for i in range(5)] == [local] * 3 + [
        FullAttentionSpec(2, 16, F32), local]
    wrapped = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
               "text_config": {**llama4, "attention_chunk_size": None}}
    assert set(specs(wrapped).values()) == {FullAttentionSpec(4, 16, F32)}


def test_jamba_periods_minimax_flags_kimi_one_indexed() -> None:
    jamba = dict(model_type="jamba", num_hidden_layers=8, attn_layer_period=4,
                 attn_layer_offset=2, expert_layer_period=2, expert_layer_offset=1,
                 num_experts=4, hidden_size=32, mamba_expand=2, mamba_d_state=16,
                 mamba_d_conv=4, num_attention_heads=4, num_key_value_heads=2)
    got = specs(jamba)
    assert [i for i in range(8) if isinstance(got[f"layers.{i}"], FullAttentionSpec)] == [2, 6]
    assert got["layers.0"].component("ssm").shape == (64, 16)
    minimax = dict(model_type="minimax", num_hidden_layers=3, attn_type_list=[0, 1, 0],
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, hidden_size=32)
    got = specs(minimax, mamba_ssm_cache_dtype="float32", model_dtype=torch.bfloat16)
    assert isinstance(got["layers.1"], FullAttentionSpec)
    assert got["layers.0"].component("kv").shape == (4, 8, 8)
    assert got["layers.0"].component("kv").dtype == F32
    kimi = dict(model_type="kimi_linear", num_hidden_layers=4, kv_lora_rank=512,
                qk_rope_head_dim=64, hidden_size=64, num_attention_heads=4,
                linear_attn_config=dict(full_attn_layers=[2], kda_layers=[1, 3, 4], num_heads=4,
                                        head_dim=16, short_conv_kernel_size=4))
    got = specs(kimi, model_dtype=torch.bfloat16)
    assert got["layers.1"] == MLASpec(576, torch.bfloat16)
    assert got["layers.1"].page_bytes(16) == 16 * 576 * 2
    kda = got["layers.0"]
    assert kda.component("conv").shape == (3 * 64, 3)
    assert kda.component("ssm").shape == (4, 16, 16) and kda.component("ssm").dtype == F32


def test_two_caches_per_layer_and_per_use() -> None:
    falcon = dict(model_type="falcon_h1", num_hidden_layers=2, hidden_size=32, mamba_d_ssm=48,
                  mamba_n_heads=4, mamba_d_head="auto", mamba_n_groups=1, mamba_d_state=8,
                  mamba_d_conv=4, num_attention_heads=4, num_key_value_heads=2)
    got = specs(falcon)
    assert set(got) == {"layers.0", "layers.0.mamba", "layers.1", "layers.1.mamba"}
    assert got["layers.0.mamba"].component("ssm").shape == (4, 12, 8)
    zamba = dict(model_type="zamba2", num_hidden_layers=4, hidden_size=32, n_mamba_heads=4,
                 mamba_expand=2, mamba_ngroups=1, mamba_d_state=8, mamba_d_conv=4,
                 num_attention_heads=4, num_key_value_heads=4,
                 layers_block_type=["mamba", "hybrid", "mamba", "hybrid"])
    got = specs(zamba)
    assert sorted(n for n in got if n.endswith(".attn")) == ["layers.1.attn", "layers.3.attn"]
    assert got["layers.1.attn"].head_dim == 2 * 32 // 4


@pytest.mark.parametrize("cfg, match", [
    (dict(model_type="lfm2", num_hidden_layers=2, layer_types=["conv", "mamba"], hidden_size=8,
          conv_L_cache=3, num_attention_heads=2), "unknown layer type 'mamba'.*conv"),
    (dict(model_type="zamba2", num_hidden_layers=1, layers_block_type=["moe"], hidden_size=8,
          n_mamba_heads=2, mamba_expand=2, mamba_ngroups=1, mamba_d_state=4, mamba_d_conv=4,
          num_attention_heads=2), "unknown layer type 'moe'"),
    (dict(model_type="mamba2", num_hidden_layers=1, num_heads=3, head_dim=4, n_groups=1,
          state_size=4, conv_kernel=4), "not divisible by tensor_parallel_size 2"),
    (dict(model_type="gpt_oss", num_hidden_layers=2, num_attention_heads=2, hidden_size=8,
          head_dim=4), "no 'sliding_window'"),
])
def test_bad_configs_are_clear_errors(cfg: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        specs(cfg, tensor_parallel_size=2 if cfg["model_type"] == "mamba2" else 1)


def test_gpt_oss_refuses_mxfp4_experts_it_cannot_block() -> None:
    """MXFP4 experts load (tests/test_mxfp4.py), but inputs that are not whole blocks of 32
    (hidden 16 here) are refused naming the tensor."""
    from transformers import GptOssConfig

    from pagefold.models.gpt_oss import GptOssForCausalLM

    cfg = GptOssConfig(hidden_size=16, intermediate_size=8, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                       num_local_experts=2, num_experts_per_tok=1, vocab_size=32)
    model = GptOssForCausalLM(cfg, max_positions=8)
    blocks = torch.zeros(2, 16, 1, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"gate_up_proj_blocks: mxfp4 tensor .* in blocks of 32"):
        model.load_weights([("model.layers.0.mlp.experts.gate_up_proj_blocks", blocks)])
