"""Jamba (JambaForCausalLM): Mamba-1 and attention layers, dense or MoE feed-forwards.

Layer ``i`` is attention when ``i % attn_layer_period == attn_layer_offset`` (no positional
encoding), else a Mamba-1 mixer; its feed-forward is a softmax top-k MoE (no renormalisation)
when ``i % expert_layer_period == expert_layer_offset`` and ``num_experts > 1``, else a SwiGLU
MLP. Each layer: ``h = x + mixer(input_norm(x))``, ``y = h + ffn(pre_ff_norm(h))``.

The Mamba-1 mixer is :class:`~pagefold.layers.mamba.mamba1.Mamba1Mixer` with learned RMS norms
on dt, B and C (``dt_layernorm`` / ``b_layernorm`` / ``c_layernorm``); its state is
``StateSpec(kind="mamba1")``: ``conv (I, K - 1)``, ``ssm (I, N)``, ``I = mamba_expand * hidden``.
Tensor parallelism: as the mixer's (channels split, row-parallel ``x_proj``), attention heads
and expert widths split.
"""

from __future__ import annotations

import torch
from torch import nn

from pagefold.core.spec_families import jamba_layer_kinds
from pagefold.layers.decoder_stack import DecoderStack
from pagefold.layers.mamba.mamba1 import Mamba1Config, Mamba1Mixer
from pagefold.layers.mlp import GatedMLP
from pagefold.layers.moe import SparseMoeBlock
from pagefold.layers.norm import RMSNorm
from pagefold.layers.vocab import vocab_embedding
from pagefold.models.nemotron_h import NemotronHAttention
from pagefold.models.qwen3_5 import HybridCausalLM

__all__ = ["JambaForCausalLM", "jamba_mixer_config"]


def jamba_mixer_config(cfg) -> Mamba1Config:
    """JambaConfig's field names -> the shared Mamba-1 mixer's shapes."""
    return Mamba1Config(
        hidden_size=cfg.hidden_size, intermediate=cfg.mamba_expand * cfg.hidden_size,
        state_size=cfg.mamba_d_state, dt_rank=int(cfg.mamba_dt_rank),
        conv_kernel=cfg.mamba_d_conv, proj_bias=bool(cfg.mamba_proj_bias),
        conv_bias=bool(cfg.mamba_conv_bias), dt_norm="rms", norm_eps=cfg.rms_norm_eps,
        activation=cfg.hidden_act, what="Mamba-1 channels (mamba_expand * hidden_size)")


class JambaLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, mixer: str, moe: bool) -> None:
        super().__init__()
        self.is_attention = mixer == "attention"
        if self.is_attention:
            self.self_attn = NemotronHAttention(cfg, layer_idx)
        else:
            self.mamba = Mamba1Mixer(jamba_mixer_config(cfg), f"layers.{layer_idx}")
        if moe:
            self.feed_forward = SparseMoeBlock(
                cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                cfg.intermediate_size, norm_topk_prob=False, act=cfg.hidden_act,
                what="intermediate_size")
        else:
            self.feed_forward = GatedMLP(cfg.hidden_size, cfg.intermediate_size,
                                         act=cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, ctx):
        h = self.input_layernorm(x)
        x = x + (self.self_attn(h, ctx) if self.is_attention else self.mamba(h, ctx))
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class JambaModel(DecoderStack):
    """Embeddings -> Jamba layers -> final norm (``DecoderStack``, module path only)."""

    native_decode = False

    def __init__(self, cfg) -> None:
        super().__init__()
        kinds = jamba_layer_kinds(cfg)
        self.build_stack(
            len(kinds), lambda i: JambaLayer(cfg, i, *kinds[i]),
            lambda: vocab_embedding(cfg.vocab_size, cfg.hidden_size),
            lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            hidden_size=cfg.hidden_size, tied=bool(getattr(cfg, "tie_word_embeddings", False)),
            norm_name="final_layernorm")

class JambaForCausalLM(HybridCausalLM):
    """Loads per-expert (``experts.{e}.gate_proj``) or stacked expert weights; the router is
    ``feed_forward.router`` in checkpoints (``gate`` here)."""

    def __init__(self, cfg, max_positions: int) -> None:
        del max_positions  # no positional encoding
        super().__init__(cfg, JambaModel(cfg))

    def convert_weight(self, name: str, tensor: torch.Tensor):
        yield name.replace(".feed_forward.router.", ".feed_forward.gate."), tensor
