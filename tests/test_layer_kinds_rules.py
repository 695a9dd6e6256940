"""Per-layer kinds from plain ``config.json`` dicts, by the precedence rules documented in
``core/layer_kinds.py`` (issue 44: mutmut's survivors there; ``test_layer_kinds.py`` checks
the cache against the model on transformers configs). Every expectation is written out."""

from __future__ import annotations

import pytest

from pagefold.core.layer_kinds import layer_kinds

F, S, G, M, P, E = "full", "sliding", "gdn", "mamba2", "mlp", "moe"


@pytest.mark.parametrize("family, cfg, kinds", [
    # Llama / Qwen: layer_types, else sliding from max_window_layers on when enabled
    ("attention", {"num_hidden_layers": 4, "sliding_window": 8, "use_sliding_window": True,
                   "max_window_layers": 2}, [F, F, S, S]),
    ("attention", {"num_hidden_layers": 3, "sliding_window": 8, "use_sliding_window": True},
     [F, F, F]),  # max_window_layers defaults to the layer count
    ("attention", {"num_hidden_layers": 3, "sliding_window": 8, "max_window_layers": 0},
     [F, F, F]),  # not enabled
    ("attention", {"num_hidden_layers": 3, "use_sliding_window": True, "max_window_layers": 0},
     [F, F, F]),  # no window
    ("attention", {"n_layer": 2, "layer_types": ["sliding_attention", "full_attention"],
                   "sliding_window": 8, "use_sliding_window": True, "max_window_layers": 0},
     [S, F]),  # the list wins
    # Qwen3.5: layer_types, else every full_attention_interval-th (default 4) is attention
    ("gdn", {"num_hidden_layers": 6, "full_attention_interval": 3}, [G, G, F, G, G, F]),
    ("gdn", {"num_layers": 4}, [G, G, G, F]),
    ("gdn", {"num_hidden_layers": 2, "layer_types": ["full_attention", "linear_attention"]},
     [F, G]),
    # Nemotron-H: the list (layers_block_type, alias layer_types) wins over the pattern
    ("nemotron_h", {"hybrid_override_pattern": "M-*E"}, [M, P, F, E]),
    ("nemotron_h", {"layers_block_type": ["mamba", "attention", "mlp", "moe"],
                    "hybrid_override_pattern": "----"}, [M, F, P, E]),
    ("nemotron_h", {"layer_types": ["linear_attention", "full_attention"],
                    "hybrid_override_pattern": "--"}, [M, F]),
    ("nemotron_h", {"layers_block_type": "M*"}, [M, F]),  # a string is the pattern
    # Granite-4.0-H: layer_types (alias layers_block_type), else all Mamba
    ("granite", {"num_hidden_layers": 3}, [M, M, M]),
    ("granite", {"layers_block_type": ["mamba", "attention"]}, [M, F]),
    ("granite", {"layer_types": ["attention", "mamba"], "layers_block_type": ["mamba"] * 2},
     [F, M]),
    # Bamba: attn_layer_indices, else a layers_block_type list, else all Mamba
    ("bamba", {"num_hidden_layers": 4, "attn_layer_indices": [1, 3],
               "layers_block_type": ["attention"] * 4}, [M, F, M, F]),
    ("bamba", {"num_hidden_layers": 2, "layers_block_type": ["attention", "mamba"]}, [F, M]),
    ("bamba", {"num_hidden_layers": 2, "layers_block_type": "mamba"}, [M, M]),
    ("bamba", {"num_hidden_layers": 3}, [M, M, M]),
])
def test_kinds_follow_the_documented_precedence(family, cfg, kinds):
    assert layer_kinds(cfg, family) == kinds


@pytest.mark.parametrize("family, cfg, message", [
    ("attention", {"num_hidden_layers": 2, "layer_types": ["full_attention", "chunked"]},
     "^layer 1 of this attention config has unknown layer type 'chunked'; supported layer "
     "types: full_attention, sliding_attention$"),
    ("nemotron_h", {"num_hidden_layers": 2},
     "^Nemotron-H config has neither layers_block_type nor hybrid_override_pattern$"),
    ("nemotron_h", {"hybrid_override_pattern": "MX"},
     "^layer 1 of this Nemotron-H config has unknown layer type 'X'"),
    ("bamba", {"num_hidden_layers": 2, "attn_layer_indices": [0, 2, -1]},
     r"^Bamba attn_layer_indices \[2, -1\] are outside 0\.\.1$"),
    ("granite", {}, "^the model config has no 'num_hidden_layers' \\(or 'n_layer', "
     "'num_layers'\\), needed to size its cache$"),
    ("gdn", {"layer_types": ["mamba"]},
     "^layer 0 of this Gated DeltaNet hybrid config has unknown layer type 'mamba'"),
    ("nemotron_h", {"layers_block_type": ["gdn"]},
     "^layer 0 of this Nemotron-H config has unknown layer type 'gdn'"),
    ("granite", {"layer_types": ["mlp"]},
     "^layer 0 of this Granite-4.0-H config has unknown layer type 'mlp'"),
    ("bamba", {"layers_block_type": ["mlp"]},
     "^layer 0 of this Bamba config has unknown layer type 'mlp'"),
])
def test_bad_configs_name_what_is_wrong(family, cfg, message):
    with pytest.raises(ValueError, match=message):
        layer_kinds(cfg, family)


def test_a_missing_field_is_named_with_its_aliases():
    from pagefold.core.layer_kinds import config_get

    with pytest.raises(ValueError, match="^the model config has no 'a', needed to size its "
                       "cache$"):
        config_get({}, "a")
    with pytest.raises(ValueError, match=r"^the model config has no 'a' \(or 'b'\), needed"):
        config_get({"a": None}, "a", "b")
    assert config_get({"a": None, "b": 0}, "a", "b") == 0 and config_get({}, "a", default=3) == 3
