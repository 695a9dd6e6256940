"""``core/spec_from_config.py`` on plain ``config.json`` dicts, every shape worked out by hand
from the module docstring: family detection and its precedence, the exact errors, the KV
dtype, the SSM dtype's precedence, and the Gated DeltaNet / Mamba-2 state shapes and splits
per tensor-parallel size (written for mutmut's survivors; no model is built)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from pagefold.architectures import ARCHITECTURES, MODEL_TYPES
from pagefold.core.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec, TPSplit
from pagefold.core.spec_from_config import detect_family, layer_specs_from_config

BF16, F32 = torch.bfloat16, torch.float32


def _specs(cfg, **kw):
    return layer_specs_from_config(cfg, model_dtype=BF16, **kw)


def _raises(msg: str):
    return pytest.raises(ValueError, match=f"^{re.escape(msg)}$")


@pytest.mark.parametrize("cfg, family", [
    ({"model_type": "qwen3"}, "attention"),
    ({"architectures": ["BambaForCausalLM"]}, "bamba"),
    ({"architectures": ["NoSuchLM", "BambaForCausalLM"]}, "bamba"),
    # A family with its own reader (spec_families) wins wherever it is named.
    ({"model_type": "qwen3", "architectures": ["JambaForCausalLM"]}, "jamba"),
    # model_type: the text config's, then the top one's; then architectures, top first.
    ({"model_type": "nemotron_h", "text_config": {"model_type": "bamba"}}, "bamba"),
    ({"model_type": "qwen3_5", "text_config": {"model_type": "nope"}}, "gdn"),
    ({"model_type": "bamba", "architectures": ["NemotronHForCausalLM"]}, "bamba"),
    ({"architectures": ["BambaForCausalLM"],
      "text_config": {"architectures": ["NemotronHForCausalLM"]}}, "bamba"),
    ({"text_config": {"architectures": ["NemotronHForCausalLM"]}}, "nemotron_h"),
    (SimpleNamespace(model_type="granitemoehybrid", text_config=None), "granite"),
])
def test_detect_family(cfg, family) -> None:
    assert detect_family(cfg) == family


@pytest.mark.parametrize("cfg, mts, archs", [
    ({"model_type": "foo", "architectures": ["FooLM"],
      "text_config": {"model_type": "foo_text", "architectures": ["BarLM"]}},
     "['foo_text', 'foo']", "['FooLM', 'BarLM']"),
    ({}, "None", "None"),
    # Without a text config the config is its own text config: named twice.
    ({"model_type": "foo"}, "['foo', 'foo']", "None"),
    ({"text_config": {"model_type": "foo_text"}}, "['foo_text']", "None"),
])
def test_detect_family_error(cfg, mts, archs) -> None:
    msg = (f"unsupported architecture (model_type {mts}, architectures {archs}); supported "
           f"model types: {', '.join(MODEL_TYPES)}; supported architectures: "
           f"{', '.join(ARCHITECTURES)}")
    with _raises(msg):
        detect_family(cfg)


QWEN3 = {"model_type": "qwen3", "num_hidden_layers": 3, "num_attention_heads": 8,
         "num_key_value_heads": 4, "hidden_size": 256, "use_sliding_window": True,
         "sliding_window": 64, "max_window_layers": 1}


def test_attention_layers() -> None:
    specs = _specs(QWEN3, kv_cache_dtype="fp8")
    # head_dim: qwen3's transformers default 128 (not 256 // 8).
    full = FullAttentionSpec(4, 128, torch.float8_e4m3fn)
    swa = SlidingWindowSpec(4, 128, torch.float8_e4m3fn, 64)
    assert specs == {"layers.0": full, "layers.1": swa, "layers.2": swa}
    assert specs["layers.1"] is specs["layers.2"]
    assert specs["layers.0"].split == TPSplit(2, ((4, 1),))
    assert specs["layers.1"].split == TPSplit(2, ((4, 1),))
    for name, dtype in [("auto", BF16), ("bfloat16", BF16), ("float16", torch.float16),
                        ("float32", F32)]:
        assert _specs(QWEN3, kv_cache_dtype=name)["layers.0"].dtype is dtype
    # Per rank: 4 KV heads over 2 ranks = 2; over 8 ranks, one (replicated) head.
    assert _specs(QWEN3, tensor_parallel_size=2)["layers.1"].num_kv_heads == 2
    assert _specs(QWEN3, tensor_parallel_size=8)["layers.0"].num_kv_heads == 1
    # No num_key_value_heads: num_attention_heads.
    mha = {k: v for k, v in QWEN3.items() if k != "num_key_value_heads"}
    assert _specs(mha)["layers.0"] == FullAttentionSpec(8, 128, BF16)


def test_argument_and_config_errors() -> None:
    with _raises("tensor_parallel_size must be at least 1, got 0"):
        _specs(QWEN3, tensor_parallel_size=0)
    with _raises("num_speculative_tokens must be >= 0, got -1"):
        _specs(QWEN3, num_speculative_tokens=-1)
    with _raises("kv_cache_dtype must be one of auto, bfloat16, float16, float32, fp8; "
                 "got 'int8'"):
        _specs(QWEN3, kv_cache_dtype="int8")
    no_window = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
                 "hidden_size": 64, "layer_types": ["full_attention", "sliding_attention"]}
    with _raises("layer 1 is sliding_attention but the config has no sliding_window"):
        _specs(no_window)
    with _raises("this nemotron_h config declares no layer that keeps a cache"):
        _specs(NEMOTRON | {"hybrid_override_pattern": "--"})


GDN = {"model_type": "qwen3_next", "num_hidden_layers": 4, "full_attention_interval": 4,
       "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 512,
       "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 16,
       "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4}


def test_gdn_state_by_hand() -> None:
    specs = _specs(GDN, num_speculative_tokens=2)
    assert sorted(specs) == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert specs["layers.3"] == FullAttentionSpec(2, 64, BF16)
    st = specs["layers.0"]
    assert st is specs["layers.1"] is specs["layers.2"] and st.kind == "gdn"
    conv, ssm = st.components
    # conv_dim = 2 * 4 * 16 + 8 * 32 = 384; kernel - 1 + 2 drafts = 5 rows.
    assert (conv.name, conv.shape, conv.dtype) == ("conv", (384, 5), BF16)
    assert (ssm.name, ssm.shape, ssm.dtype) == ("ssm", (8, 16, 32), BF16)
    assert conv.split == TPSplit(0, ((64, 16), (64, 16), (256, 32)))
    assert ssm.split == TPSplit(0, ((8, 1),))
    conv2, ssm2 = _specs(GDN, tensor_parallel_size=4)["layers.0"].components
    assert (conv2.shape, ssm2.shape) == ((96, 3), (2, 16, 32))
    with _raises("linear_num_key_heads (4) is not divisible by tensor_parallel_size 3"):
        _specs(GDN, tensor_parallel_size=3)
    with _raises("linear_num_value_heads (6) is not divisible by tensor_parallel_size 4"):
        _specs(GDN | {"linear_num_value_heads": 6}, tensor_parallel_size=4)


@pytest.mark.parametrize("cfg, override, want", [
    (GDN, None, BF16),                                   # the model dtype
    (GDN | {"mamba_ssm_dtype": "float32"}, None, F32),
    (GDN | {"mamba_ssm_cache_dtype": "float16"}, None, torch.float16),
    (GDN | {"mamba_ssm_dtype": "auto"}, None, BF16),
    (GDN | {"mamba_ssm_dtype": "float32"}, "float16", torch.float16),  # the override first
    (GDN | {"mamba_ssm_dtype": "float32"}, "auto", F32),
    # Nested: the text config's field, then the top config's.
    ({"model_type": "qwen3_5", "mamba_ssm_dtype": "float32",
      "text_config": GDN | {"model_type": "qwen3_5_text"}}, None, F32),
    ({"model_type": "qwen3_5", "mamba_ssm_dtype": "float32",
      "text_config": GDN | {"model_type": "qwen3_5_text", "mamba_ssm_dtype": "float16"}},
     None, torch.float16),
])
def test_ssm_dtype_precedence(cfg, override, want) -> None:
    st = _specs(cfg, mamba_ssm_cache_dtype=override)["layers.0"]
    assert st.components[1].dtype is want and st.components[0].dtype is BF16


def test_ssm_dtype_errors() -> None:
    names = "float32, float, bfloat16, float16, half"
    with _raises(f"mamba_ssm_cache_dtype must be one of {names}; got 'fp8'"):
        _specs(GDN, mamba_ssm_cache_dtype="fp8")
    with _raises(f"the config's mamba_ssm_dtype must be one of {names}; got 'fp8'"):
        _specs(GDN | {"mamba_ssm_dtype": "fp8"})


NEMOTRON = {"model_type": "nemotron_h", "hybrid_override_pattern": "M-M*",
            "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 32,
            "conv_kernel": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "hidden_size": 256}


def test_nemotron_mamba2_by_hand() -> None:
    specs = _specs(NEMOTRON)
    assert sorted(specs) == ["layers.0", "layers.2", "layers.3"]  # layer 1 is an MLP
    assert specs["layers.3"] == FullAttentionSpec(2, 32, BF16)
    st = specs["layers.0"]
    assert st is specs["layers.2"] and st.kind == "mamba2"
    conv, ssm = st.components
    # intermediate 8 * 16 = 128; conv_dim 128 + 2 * 2 * 32 = 256; SSM float32 (the default).
    assert (conv.shape, conv.dtype, ssm.shape, ssm.dtype) == ((256, 3), BF16, (8, 16, 32), F32)
    assert conv.split == TPSplit(0, ((128, 1), (64, 32), (64, 32)))
    assert ssm.split == TPSplit(0, ((8, 1),))
    # The aliases read the same.
    alias = {k: v for k, v in NEMOTRON.items() if k not in ("n_groups", "conv_kernel")}
    alias |= {"mamba_n_groups": 2, "mamba_d_conv": 4}
    assert _specs(alias)["layers.0"] == st
    # An explicit SSM dtype wins over the family default.
    assert _specs(NEMOTRON | {"mamba_ssm_dtype": "bfloat16"})["layers.0"].components[1].dtype \
        is BF16
    c2, s2 = _specs(NEMOTRON, tensor_parallel_size=2)["layers.0"].components
    assert (c2.shape, s2.shape) == ((128, 3), (4, 16, 32))
    # One B/C group over 2 ranks: replicated, conv_dim 128 + 2 * 2 * 32 = 256 -> 128 a rank.
    one = _specs(NEMOTRON | {"n_groups": 1}, tensor_parallel_size=2)["layers.0"].components[0]
    assert one.shape == (128, 3)
    assert one.split == TPSplit(0, ((128, 1), (32, 32), (32, 32)))
    assert _specs(NEMOTRON | {"n_groups": 1})["layers.0"].components[0].shape == (192, 3)
    with _raises("Mamba-2 n_groups (3) must be 1 or divisible by tensor_parallel_size 2"):
        _specs(NEMOTRON | {"n_groups": 3}, tensor_parallel_size=2)
    with _raises("Mamba-2 heads (8) is not divisible by tensor_parallel_size 16"):
        _specs(NEMOTRON | {"n_groups": 16, "mamba_num_heads": 8, "mamba_head_dim": 32,
                           "num_key_value_heads": 16}, tensor_parallel_size=16)


BAMBA = {"model_type": "bamba", "num_hidden_layers": 3, "attn_layer_indices": [1],
         "mamba_n_heads": 8, "mamba_expand": 2, "hidden_size": 64, "mamba_n_groups": 1,
         "mamba_d_state": 16, "mamba_d_conv": 4, "num_attention_heads": 4,
         "num_key_value_heads": 1}


def test_bamba_mamba2_by_hand() -> None:
    specs = _specs(BAMBA, num_speculative_tokens=2)
    assert specs["layers.1"] == FullAttentionSpec(1, 16, BF16)  # 64 // 4
    conv, ssm = specs["layers.0"].components
    # intermediate 2 * 64 = 128; head_dim "auto" = 128 // 8 = 16; conv_dim 128 + 2 * 16.
    assert (conv.shape, ssm.shape, ssm.dtype) == ((160, 5), (8, 16, 16), BF16)
    assert specs["layers.2"] is specs["layers.0"]
    explicit = _specs(BAMBA | {"mamba_d_head": 32})["layers.0"].components[1]
    assert explicit.shape == (8, 32, 16)
    auto = _specs(BAMBA | {"mamba_d_head": "auto"})["layers.0"].components[1]
    assert auto.shape == (8, 16, 16)


def test_shapes_are_ints_and_names() -> None:
    """Shapes are tensor sizes: ints, never ``192.0`` (equal, but not a size)."""
    sizes = []
    for cfg, tp in [(GDN, 4), (NEMOTRON, 2), (BAMBA, 1), (QWEN3, 2)]:
        for spec in _specs(cfg, tensor_parallel_size=tp).values():
            if hasattr(spec, "components"):
                assert [c.name for c in spec.components] == ["conv", "ssm"]
                sizes += [n for c in spec.components for n in c.shape]
            else:
                sizes += [spec.num_kv_heads, spec.head_dim]
    assert {type(n) for n in sizes} == {int}
    with _raises("Mamba-2 conv_dim (131) is not divisible by tensor_parallel_size 2"):
        # intermediate 3 * 1 = 3, plus 2 * 2 * 32: odd.
        _specs(NEMOTRON | {"mamba_num_heads": 3, "mamba_head_dim": 1}, tensor_parallel_size=2)


def test_one_spec_object_per_kind() -> None:
    """Layers of one kind share one spec object (the planner groups equal specs)."""
    specs = _specs(GDN | {"num_hidden_layers": 8})
    assert specs["layers.3"] is specs["layers.7"]
    assert specs["layers.0"] is specs["layers.6"]
    # A sliding layer first: the attention shape is still read once, for both kinds.
    cfg = {"model_type": "llama", "num_hidden_layers": 3, "num_attention_heads": 4,
           "num_key_value_heads": 2, "hidden_size": 64, "sliding_window": 8,
           "layer_types": ["sliding_attention", "full_attention", "full_attention"]}
    specs = _specs(cfg)
    assert specs["layers.0"] == SlidingWindowSpec(2, 16, BF16, 8)
    assert specs["layers.1"] == FullAttentionSpec(2, 16, BF16)
    assert specs["layers.1"] is specs["layers.2"]


def test_family_readers_get_every_argument() -> None:
    """A family with its own reader (``spec_families``) gets the text config, the dtypes, the
    TP size, the SSM override and the draft count."""
    m2 = {"model_type": "mamba2", "num_hidden_layers": 2, "num_heads": 8, "head_dim": 16,
          "n_groups": 1, "state_size": 16, "conv_kernel": 4}
    specs = _specs({"architectures": ["Mamba2ForCausalLM"], "text_config": m2},
                   tensor_parallel_size=2, mamba_ssm_cache_dtype="float32",
                   num_speculative_tokens=1)
    assert sorted(specs) == ["layers.0", "layers.1"]
    conv, ssm = specs["layers.0"].components
    # conv_dim 8 * 16 + 2 * 2 * 16 (one group, replicated) = 192 -> 96 a rank; 3 + 1 rows.
    assert (conv.shape, conv.dtype, ssm.shape, ssm.dtype) == ((96, 4), BF16, (4, 16, 16), F32)
    g3 = {"model_type": "gemma3_text", "num_hidden_layers": 2, "sliding_window": 32,
          "layer_types": ["sliding_attention", "full_attention"], "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16}
    assert _specs(g3, kv_cache_dtype="float16")["layers.1"] == FullAttentionSpec(
        2, 16, torch.float16)
    with _raises("this gemma3 config declares no layer that keeps a cache"):
        _specs(g3 | {"num_hidden_layers": 0, "layer_types": []})
