"""One parser of layer kinds: the cache sized from a config and the model built from it agree,
and both follow transformers where a config names its layers two ways."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagefold.core.layer_kinds import layer_kinds
from pagefold.core.spec_from_config import layer_specs_from_config
from pagefold.models.granite_hybrid import hybrid_layer_kinds
from pagefold.models.nemotron_h import nemotron_h_block_kinds
from pagefold.testing.tiny_models import arch_config_kwargs


def _cached_layers(cfg) -> list[int]:
    specs = layer_specs_from_config(cfg, model_dtype=torch.float32)
    return sorted(int(k.split(".")[1]) for k in specs)


def test_nemotron_list_wins_over_pattern_in_cache_and_model():
    kw = arch_config_kwargs("nemotron_h")
    kw["hybrid_override_pattern"] = "-M-*-M"  # disagrees with layers_block_type "M-*-M-"
    kw["model_type"] = "nemotron_h"
    hf = transformers.NemotronHConfig(**{k: v for k, v in kw.items() if k != "model_type"})
    assert hf.layers_block_type[0] == "linear_attention"  # transformers: the list wins
    model_kinds = nemotron_h_block_kinds(hf)
    assert model_kinds == ["mamba", "mlp", "attention", "mlp", "mamba", "mlp"]
    cached = [i for i, k in enumerate(model_kinds) if k in ("mamba", "attention")]
    assert _cached_layers(kw) == cached  # the config.json dict, as the planner reads it
    assert _cached_layers(hf) == cached


def test_nemotron_pattern_alone_still_read():
    kw = arch_config_kwargs("nemotron_h")
    del kw["layers_block_type"]
    kw.update(hybrid_override_pattern="M*-E", model_type="nemotron_h")
    assert layer_kinds(kw, "nemotron_h") == ["mamba2", "full", "mlp", "moe"]
    assert _cached_layers(kw) == [0, 1]
    with pytest.raises(ValueError, match="unknown layer type 'X'"):
        layer_kinds(dict(kw, hybrid_override_pattern="MX"), "nemotron_h")


def test_granite_layer_types_win_in_cache_and_model():
    kw = arch_config_kwargs("granitemoehybrid")
    hf = transformers.GraniteMoeHybridConfig(**kw)
    d = dict(kw, model_type="granitemoehybrid",
             layers_block_type=["mamba", "mamba", "mamba", "attention"])
    model = [i for i, k in enumerate(hybrid_layer_kinds(hf)) if k == "attention"]
    assert model == [1]
    specs = layer_specs_from_config(d, model_dtype=torch.float32)
    attn = [k for k, s in specs.items() if type(s).__name__ == "FullAttentionSpec"]
    assert attn == ["layers.1"]  # layer_types (the canonical name) wins
