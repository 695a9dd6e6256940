"""Depthwise causal conv1d over flat varlen batches: the one entry models call.

:func:`causal_conv1d` picks the form of a layer's step: the per-token (verify) form, the
single-token decode update, or the varlen form for prefill chunks (the compiled CPU conv,
``csrc/conv.cpp``, where it takes the inputs, and in-step checkpoint captures). The Triton
forms over paged states (:mod:`.triton`) are run by the state ops that own a conv (GDN,
Mamba-2), inside their fused steps. The torch forms are re-exported (``causal_conv1d_naive``
the reference).
"""

from __future__ import annotations

import torch

from pagefold.ops.common.capture import Capture
from pagefold.ops.conv1d.reference import (
    causal_conv1d_naive,
    causal_conv1d_state_at,
    causal_conv1d_update,
    causal_conv1d_varlen,
    causal_conv1d_verify,
    causal_conv1d_verify_naive,
)

__all__ = ["causal_conv1d", "causal_conv1d_naive", "causal_conv1d_state_at",
           "causal_conv1d_update", "causal_conv1d_varlen", "causal_conv1d_verify",
           "causal_conv1d_verify_naive"]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  conv_state: torch.Tensor, cu_seqlens: torch.Tensor,
                  activation: str | None = "silu", *, decode: bool = False,
                  verify: bool = False, capture: Capture | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y (T, C), states)`` for a step: with ``verify``, the window after every token
    (T, C, K-1); with ``decode`` (one token per sequence), the update; else the varlen form
    (``capture``: its in-step checkpoints). Inputs as :mod:`.reference` describes them."""
    if verify:
        return causal_conv1d_verify(x, weight, bias, conv_state, cu_seqlens, activation)
    if decode:
        return causal_conv1d_update(x, weight, bias, conv_state, activation)
    return causal_conv1d_varlen(x, weight, bias, conv_state, cu_seqlens, activation,
                                capture=capture)
