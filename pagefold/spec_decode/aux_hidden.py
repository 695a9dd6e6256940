"""The target-side seam of EAGLE-3: capturing the hidden states entering chosen decoder layers.

An EAGLE-3 drafter consumes, for every target row, the concatenation of the hidden states
entering three target layers (low, middle, high; vLLM's default ``(2, n // 2, n - 3)`` for an
``n``-layer target, a draft config's ``eagle_aux_hidden_state_layer_ids`` otherwise).
:func:`attach_capture` puts a forward pre-hook on each of those layers (``model.model.layers``);
a hook stores its layer's input into ``ctx.aux_hidden`` only on forwards whose
:class:`~pagefold.executor.forward_context.ForwardContext` names layers to capture
(``ctx.aux_layers``, set by the runner when its proposer asks): any other forward, and every
model without an EAGLE-3 drafter, pays nothing. Such a forward also skips the CUDA-graph and
native decode paths, which do not call the layers one by one.

The hidden state entering a layer is the residual stream: pagefold's decoder layers take it
either whole (``layer(positions, x, ctx)``) or as ``x + residual`` (the fused add + norm
convention of ``layer(positions, x, ctx, residual)``, residual None before the first layer);
the hook sums the (T, hidden) floating-point arguments.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pagefold.executor.forward_context import ForwardContext

__all__ = ["attach_capture", "decoder_layers", "default_aux_layer_ids"]


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default ``(2, n // 2, n - 3)``, each clamped into ``[0, n - 1]`` so that tiny
    targets (fewer than 6 layers) still name real layers."""
    top = num_layers - 1
    return tuple(min(max(i, 0), top) for i in (2, num_layers // 2, num_layers - 3))


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The target's decoder layers (``model.model.layers``); ValueError when it has none
    there (an EAGLE-3 drafter then cannot read its hidden states)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(f"EAGLE-3 needs the target's decoder layers at model.layers; "
                         f"{type(model).__name__} has none there")
    return layers


def _layer_input(args: Sequence, kwargs: dict, width: int) -> torch.Tensor | None:
    parts = [a for a in (*args, *kwargs.values())
             if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim() == 2
             and a.shape[-1] == width]
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out


def attach_capture(model: nn.Module, layer_ids: Sequence[int], hidden_size: int) -> None:
    """Hook the target's layers ``layer_ids`` (see the module docstring). Raises ValueError
    for an index outside the model's layers."""
    layers = decoder_layers(model)
    for i in layer_ids:
        if not 0 <= i < len(layers):
            raise ValueError(f"eagle_aux_hidden_state_layer_ids names layer {i}; the target "
                             f"has layers 0..{len(layers) - 1}")
    for i in sorted(set(layer_ids)):
        def hook(module, args, kwargs, i=i):
            ctx = next((a for a in (*args, *kwargs.values()) if isinstance(a, ForwardContext)),
                       None)
            if ctx is None or ctx.aux_layers is None or i not in ctx.aux_layers:
                return None
            x = _layer_input(args, kwargs, hidden_size)
            if x is None:
                raise ValueError(f"target layer {i}: no (T, {hidden_size}) input to capture")
            ctx.aux_hidden[i] = x.clone()  # the residual stream may be updated in place
            return None

        layers[i].register_forward_pre_hook(hook, with_kwargs=True)
