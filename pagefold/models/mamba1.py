"""Mamba (MambaForCausalLM) and Falcon-Mamba (FalconMambaForCausalLM): Mamba-1-only stacks.

No attention and no positional encoding: each block is ``x + mixer(norm(x))`` with the shared
Mamba-1 mixer (:class:`~pagefold.layers.mamba.mamba1.Mamba1Mixer`), then a final RMSNorm and
the LM head. The two differ only in the mixer: Falcon-Mamba RMS-normalises dt, B and C after
``x_proj`` without weights (``mixer_rms_eps``), Mamba does not normalise them.
``residual_in_fp32`` keeps the residual stream in float32 between blocks, as transformers does.

The cache pool holds only ``mamba1`` states (``conv (I, K - 1)``, ``ssm (I, N)`` per layer,
``I = expand * hidden_size``), so prefix caching works through state checkpoints alone.
Weights live under ``backbone.`` (older Mamba checkpoints name the embedding
``backbone.embedding``); the shell is Mamba-2's (:class:`~pagefold.models.mamba2.
Mamba2ForCausalLM`). These models take the module path on every step: the native CPU decode
driver (``layers/decode_native``) has no Mamba-1 record.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagefold.executor.forward_context import ForwardContext
from pagefold.layers.mamba.mamba1 import Mamba1Config, Mamba1Mixer
from pagefold.layers.norm import RMSNorm
from pagefold.models.mamba2 import Mamba2ForCausalLM, StateOnlyStack

__all__ = ["FalconMambaForCausalLM", "MambaForCausalLM", "mamba1_mixer_config"]


def mamba1_mixer_config(cfg, dt_norm: str) -> Mamba1Config:
    """MambaConfig / FalconMambaConfig field names -> the shared mixer's shapes
    (``time_step_rank`` ``"auto"`` is ``ceil(hidden / 16)``, as transformers resolves it)."""
    rank = cfg.time_step_rank
    rank = math.ceil(cfg.hidden_size / 16) if rank == "auto" else int(rank)
    return Mamba1Config(
        hidden_size=cfg.hidden_size, intermediate=int(cfg.expand * cfg.hidden_size),
        state_size=cfg.state_size, dt_rank=rank, conv_kernel=cfg.conv_kernel,
        proj_bias=bool(cfg.use_bias), conv_bias=bool(cfg.use_conv_bias),
        dt_norm=dt_norm,
        norm_eps=float(getattr(cfg, "mixer_rms_eps", 1e-6)),
        activation=getattr(cfg, "hidden_act", "silu"),
        what="Mamba-1 channels (expand * hidden_size)")


class Mamba1Block(nn.Module):
    def __init__(self, cfg, layer_idx: int, dt_norm: str) -> None:
        super().__init__()
        self.residual_in_fp32 = bool(getattr(cfg, "residual_in_fp32", True))
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.mixer = Mamba1Mixer(mamba1_mixer_config(cfg, dt_norm), f"layers.{layer_idx}")

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.mixer(self.norm(x.to(self.norm.weight.dtype)), ctx)
        residual = x.float() if self.residual_in_fp32 else x
        return residual + h


class MambaModel(StateOnlyStack):
    """The backbone; ``dt_norm`` is the mixers' (``Mamba1Config.dt_norm``)."""

    dt_norm = "none"
    native_decode = False

    def __init__(self, cfg) -> None:
        super().__init__()
        self.init_state_stack(cfg, lambda i: Mamba1Block(cfg, i, self.dt_norm))

class FalconMambaModel(MambaModel):
    dt_norm = "weightless"


class MambaForCausalLM(Mamba2ForCausalLM):
    """``forward(input_ids (T,), positions (T,), ctx) -> (T, hidden)`` (positions unused)."""

    backbone_class = MambaModel


class FalconMambaForCausalLM(Mamba2ForCausalLM):
    """As :class:`MambaForCausalLM`; the mixers normalise dt, B and C (no weights to load)."""

    backbone_class = FalconMambaModel
