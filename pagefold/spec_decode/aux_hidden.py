"""The target-side seam of EAGLE / EAGLE-3 / MTP drafters: the target's decoder stack, its
token embeddings, and the hidden states entering chosen decoder layers.

An EAGLE-3 drafter consumes, for every target row, the concatenation of the hidden states
entering three target layers (low, middle, high; vLLM's default ``(2, n // 2, n - 3)`` for an
``n``-layer target, a draft config's ``eagle_aux_hidden_state_layer_ids`` otherwise). The
capture is the decoder stack's own, the same for every architecture: a stack that declares
``captures_layer_inputs`` (every ``layers.decoder_stack.DecoderStack``, and Zamba2's) hands
each layer's input to ``ctx.capture_layer_input`` when the step's
:class:`~pagefold.executor.forward_context.ForwardContext` names layers to capture
(``ctx.aux_layers``, set by the runner when its proposer asks); any other forward, and every
model without an EAGLE-3 drafter, pays one branch per step. Such a forward also skips the
CUDA-graph and native decode paths, which do not run the layers one by one.

The hidden state entering a layer is the residual stream (what transformers reports as
``hidden_states[i]``): ``x`` for the stacks whose layers take and return the whole stream,
``x + residual`` for those with the fused add + norm convention.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["check_aux_layers", "default_aux_layer_ids", "target_embedding", "target_stack"]


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default ``(2, n // 2, n - 3)``, each clamped into ``[0, n - 1]`` so that tiny
    targets (fewer than 6 layers) still name real layers."""
    top = num_layers - 1
    return tuple(min(max(i, 0), top) for i in (2, num_layers // 2, num_layers - 3))


def target_stack(model: nn.Module) -> nn.Module:
    """The target's decoder stack (the child module that declares ``captures_layer_inputs``:
    ``model.model`` or ``model.backbone``); ValueError when it has none (a hidden-state
    drafter then cannot read its layers)."""
    for child in model.children():
        if getattr(child, "captures_layer_inputs", False):
            return child
    raise ValueError(f"{type(model).__name__} has no decoder stack that hands its layers' "
                     f"inputs to a drafter (EAGLE / MTP need one)")


def target_embedding(model: nn.Module) -> nn.Module:
    """The target's token embedding table (no scaling of its rows): an EAGLE or MTP head
    without embeddings of its own looks its tokens up there."""
    return target_stack(model).token_embedding


def check_aux_layers(model: nn.Module, layer_ids: Sequence[int]) -> None:
    """ValueError when ``layer_ids`` names a layer the target does not have."""
    n = len(target_stack(model).layers)
    for i in layer_ids:
        if not 0 <= i < n:
            raise ValueError(f"eagle_aux_hidden_state_layer_ids names layer {i}; the target "
                             f"has layers 0..{n - 1}")
