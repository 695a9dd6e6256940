"""Jamba (JambaForCausalLM): Mamba-1 and attention layers, dense or MoE feed-forwards.

Layer ``i`` is attention when ``i % attn_layer_period == attn_layer_offset`` (no positional
encoding), else a Mamba-1 mixer; its feed-forward is a softmax top-k MoE (no renormalisation)
when ``i % expert_layer_period == expert_layer_offset`` and ``num_experts > 1``, else a SwiGLU
MLP. Each layer: ``h = x + mixer(input_norm(x))``, ``y = h + ffn(pre_ff_norm(h))``.

Mamba-1 mixer (transformers' JambaMambaMixer), for a flat batch::

    xs, z = split(in_proj(x), 2)                      (T, I) each
    xs = silu(causal_conv1d(xs))                      conv state (I, K - 1)
    dt_r, B, C = split(x_proj(xs), [R, N, N]); RMS-normalise each (dt/b/c_layernorm)
    dt = dt_proj.weight @ dt_r                        the bias goes inside the softplus
    y = selective_scan(xs, dt, A = -exp(A_log), B, C, D, z)     ssm state (I, N) float32
    out = out_proj(y)

The state is ``StateSpec(kind="mamba1")``: ``conv (I, K - 1)``, ``ssm (I, N)``.

Tensor parallelism (as vLLM's Mamba-1): the I channels split over the ranks -- in_proj's xs
and z rows, conv channels, ``A_log``, ``D``, ``dt_proj`` rows and the states --; ``x_proj``
is row-parallel (its dt/B/C read every channel: one all-reduce), so the small dt/B/C norms
see the full vectors on every rank; ``out_proj`` is row-parallel.
"""

from __future__ import annotations

import torch
from torch import nn

from pagefold.core.spec_families import jamba_layer_kinds
from pagefold.executor.forward_context import ForwardContext
from pagefold.layers.linear import column_linear, row_linear, shard_rows
from pagefold.layers.mlp import GatedMLP
from pagefold.layers.moe import SparseMoeBlock
from pagefold.layers.norm import RMSNorm
from pagefold.layers.vocab import vocab_embedding
from pagefold.models.nemotron_h import NemotronHAttention
from pagefold.models.qwen3_5 import HybridCausalLM
from pagefold.ops.conv1d import causal_conv1d
from pagefold.ops.selective_scan import selective_scan

__all__ = ["JambaForCausalLM", "Mamba1Mixer"]


class Mamba1Mixer(nn.Module):
    """Jamba's Mamba-1 mixer; ``layer_name`` is its state layer."""

    def __init__(self, cfg, layer_name: str) -> None:
        super().__init__()
        self.layer_name = layer_name
        h = cfg.hidden_size
        full = cfg.mamba_expand * h
        self.state_size = n = cfg.mamba_d_state
        self.rank = r = int(cfg.mamba_dt_rank)
        self.kernel = cfg.mamba_d_conv
        bias = bool(cfg.mamba_proj_bias)
        what = "Mamba-1 channels (mamba_expand * hidden_size)"
        self.in_proj = column_linear(h, [full, full], bias=bias, what=what)  # xs | z rows
        self.inter = inter = self.in_proj.out_features // 2  # this rank's channels
        self.conv1d = nn.Conv1d(inter, inter, self.kernel, groups=inter,
                                bias=bool(cfg.mamba_conv_bias), padding=self.kernel - 1)
        self.x_proj = row_linear(full, r + 2 * n, bias=False, what=what)
        self.dt_proj = column_linear(r, full, bias=True, what=what)
        self.A_log = nn.Parameter(torch.zeros(inter, n))
        self.D = nn.Parameter(torch.ones(inter))
        for p in (*self.conv1d.parameters(), self.A_log, self.D):
            shard_rows(p, [full], what)
        self.out_proj = row_linear(full, h, bias=bias, what=what)
        self.dt_layernorm = RMSNorm(r, cfg.rms_norm_eps)
        self.b_layernorm = RMSNorm(n, cfg.rms_norm_eps)
        self.c_layernorm = RMSNorm(n, cfg.rms_norm_eps)
        if cfg.hidden_act not in ("silu", "swish"):
            raise ValueError(f"Jamba's Mamba activation {cfg.hidden_act!r} is not supported")

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        _, meta = ctx.state(self.layer_name)
        states = ctx.load_states(self.layer_name)
        weight = self.conv1d.weight.view(self.inter, self.kernel)
        xs, conv = causal_conv1d(xs, weight, self.conv1d.bias, states["conv"], meta.cu_seqlens,
                                 activation="silu", decode=meta.all_decode)
        dt, b, c = self.x_proj(xs).split([self.rank, self.state_size, self.state_size], dim=-1)
        dt = self.dt_layernorm(dt) @ self.dt_proj.weight.t()
        b, c = self.b_layernorm(b), self.c_layernorm(c)
        y, ssm = selective_scan(xs, dt, -torch.exp(self.A_log.float()), b, c, self.D, z,
                                states["ssm"], meta.cu_seqlens, dt_bias=self.dt_proj.bias,
                                dt_softplus=True, decode=meta.all_decode)
        ctx.store_states(self.layer_name, {"conv": conv, "ssm": ssm})
        return self.out_proj(y.to(x.dtype))


class JambaLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, mixer: str, moe: bool) -> None:
        super().__init__()
        self.is_attention = mixer == "attention"
        if self.is_attention:
            self.self_attn = NemotronHAttention(cfg, layer_idx)
        else:
            self.mamba = Mamba1Mixer(cfg, f"layers.{layer_idx}")
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


class JambaModel(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(JambaLayer(cfg, i, mixer, moe)
                                    for i, (mixer, moe) in enumerate(jamba_layer_kinds(cfg)))
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, ctx):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x, ctx)
        return self.final_layernorm(x)


class JambaForCausalLM(HybridCausalLM):
    """Loads per-expert (``experts.{e}.gate_proj``) or stacked expert weights; the router is
    ``feed_forward.router`` in checkpoints (``gate`` here)."""

    def __init__(self, cfg, max_positions: int) -> None:
        del max_positions  # no positional encoding
        super().__init__(cfg, JambaModel(cfg))

    def convert_weight(self, name: str, tensor: torch.Tensor):
        yield name.replace(".feed_forward.router.", ".feed_forward.gate."), tensor
