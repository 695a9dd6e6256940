"""The model's LoRA-able linears: every ``nn.Linear`` (``RowParallelLinear`` included) inside
the decoder layers, with its checkpoint parts (a fused ``qkv_proj`` has ``q_proj`` /
``k_proj`` / ``v_proj``; an unfused layer one part named as the layer) and how tensor
parallelism cuts it (``layers/linear.py``: ``tp_cuts`` on column-parallel layers, or a model's
``loader_cuts``); and the routed experts' stacks (``lora_stack()``) with their layouts."""

from __future__ import annotations

import re

import torch
from torch import nn

from pagefold.distributed.parallel_state import tp_size
from pagefold.layers.linear import RowParallelLinear
from pagefold.layers.lora_experts import ExpertsLayout
from pagefold.layers.lora_linear import LinearLayout, PartLayout


def linear_layout(module: nn.Linear, own_name: str) -> LinearLayout:
    out = module.weight.shape[0]
    if isinstance(module, RowParallelLinear):
        return LinearLayout("row", module.in_features, module.in_features * tp_size(),
                            {own_name: PartLayout(0, out, out)}, reduce=module.reduce)
    fused = getattr(module.weight, "fused", None)
    # ``loader_cuts``: the column cut of a layer its model's own loader cuts (Granite-4.0-H's
    # shared ``input_linear``), known to LoRA and GGUF layers (other quantized layers refuse
    # its split).
    cuts = getattr(module, "tp_cuts", None) or getattr(module, "loader_cuts", None)
    shards = fused.shards if fused is not None else {"": (0, out)}
    parts = {}
    for key, (off, rows) in shards.items():
        cut = cuts.get(key) if cuts else None
        full = sum(cut.blocks) if cut is not None else rows
        parts[key or own_name] = PartLayout(off, rows, full, cut)
    kind = "column" if cuts else "replicated"
    return LinearLayout(kind, module.in_features, module.in_features, parts)


# Routed experts kept as per-expert linears (Nemotron-H's ``experts.{e}``) run on their routed
# rows only, not on the step's rows the per-row adapter index follows: they take no adapters.
_ROUTED_LINEAR = re.compile(r"\.experts\.\d+\.")


def lora_layout(model: nn.Module) -> dict[str, tuple[nn.Linear, LinearLayout]]:
    """Module path -> (linear, layout) for every LoRA-able linear of ``model`` (its lm_head
    and embeddings excluded: adapters on them are refused by name; so are routed experts'
    per-expert linears)."""
    found = {}
    for path, mod in model.named_modules():
        if (not isinstance(mod, nn.Linear) or ".layers." not in f".{path}"
                or _ROUTED_LINEAR.search(f".{path}")):
            continue
        found[path] = (mod, linear_layout(mod, path.rsplit(".", 1)[-1]))
    return found


def experts_layouts(model: nn.Module
                    ) -> dict[str, tuple[nn.Module, ExpertsLayout, torch.Tensor]]:
    """Adapter module path (transformers', e.g. ``model.layers.0.mlp.experts``) -> (stack,
    layout, a weight for dtype and device) for every routed expert stack of ``model`` that
    describes itself with ``lora_stack()`` (:class:`~pagefold.layers.moe.MoEExperts`,
    Granite-4.0-H's experts; quantized experts, whose stacks are gone, take no adapters)."""
    found = {}
    for path, mod in model.named_modules():
        stack = mod.lora_stack() if callable(getattr(mod, "lora_stack", None)) else None
        if stack is not None and ".layers." in f".{path}":
            suffix, lay, like = stack
            found[path + suffix] = (mod, lay, like)
    return found
