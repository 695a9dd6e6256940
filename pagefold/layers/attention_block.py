"""The GQA attention block the models share: fused qkv projection, optional q/k RMSNorm,
RoPE on all, some (partial rotary) or none (NoPE) of each head's channels, paged attention
through the forward context, output projection.

``forward(positions (T,), x (T, hidden), ctx) -> (T, hidden)``. With full RoPE the compiled
q/k norm + RoPE kernel runs when it takes the inputs (same roundings as the torch path).
"""

from __future__ import annotations

import torch
from torch import nn

from pagefold.distributed.parallel_state import tp_size
from pagefold.executor.forward_context import ForwardContext
from pagefold.layers.linear import column_linear, row_linear
from pagefold.layers.native_record import Step, attention_record
from pagefold.layers.norm import RMSNorm
from pagefold.layers.rotary import RotaryEmbedding
from pagefold.ops import elementwise

FULL_ROTARY = -1  # rotary_dim value: rotate every channel of the head


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def split_heads(num_heads: int, num_kv_heads: int, tp: int | None = None
                ) -> tuple[int, int, int]:
    """Per-rank (query heads, KV heads, parts the KV heads are cut in). KV heads fewer than
    ranks are replicated (each rank keeps one), as the cache planner assumes. A ValueError
    naming the field when they do not divide."""
    tp = tp_size() if tp is None else tp
    if num_heads % tp:
        raise ValueError(f"num_attention_heads ({num_heads}) is not divisible by "
                         f"tensor_parallel_size {tp}")
    if (num_kv_heads >= tp and num_kv_heads % tp) or (num_kv_heads < tp and tp % num_kv_heads):
        raise ValueError(f"num_key_value_heads ({num_kv_heads}) and tensor_parallel_size {tp} "
                         f"do not divide one another")
    return num_heads // tp, max(1, num_kv_heads // tp), min(num_kv_heads, tp)


class GQAAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int, *, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 max_positions: int, rotary_dim: int | None = FULL_ROTARY,
                 scale: float | None = None) -> None:
        """``rotary_dim``: ``FULL_ROTARY``, a channel count (partial), or None (NoPE).
        ``scale``: softmax scale (default ``head_dim ** -0.5``)."""
        super().__init__()
        self.layer_name = f"layers.{layer_idx}"
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        self.num_heads, self.num_kv_heads, kv_parts = split_heads(heads, kv_heads)
        self.head_dim = d = head_dim_of(cfg)
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.qkv_proj = column_linear(
            cfg.hidden_size, {"q_proj": heads * d, "k_proj": kv_heads * d, "v_proj": kv_heads * d},
            bias=qkv_bias, parts={"k_proj": kv_parts, "v_proj": kv_parts}, what="attention")
        self.o_proj = row_linear(heads * d, cfg.hidden_size, bias=o_bias,
                                 what="attention output")
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        full = rotary_dim == FULL_ROTARY or rotary_dim == self.head_dim
        self.rotary = None if rotary_dim is None else RotaryEmbedding(
            cfg, self.head_dim, max_positions, rotary_dim=None if full else rotary_dim)
        self.fused_rope = self.rotary is not None and full
        self.scale = self.head_dim**-0.5 if scale is None else scale

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        qk = None
        if self.fused_rope:  # one pass for q/k norm + RoPE when the compiled kernel takes it
            qk = elementwise.qk_norm_rope(
                qkv, positions, self.rotary.cos, self.rotary.sin, num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, q_off=0,
                q_head_stride=self.head_dim, k_off=self.q_size,
                q_weight=self.q_norm.weight if self.q_norm is not None else None,
                k_weight=self.k_norm.weight if self.k_norm is not None else None,
                eps=self.q_norm.eps if self.q_norm is not None else 0.0, zero_centered=False)
        if qk is not None:
            q, k = qk
        else:
            q = q.view(t, self.num_heads, self.head_dim)
            k = k.view(t, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            if self.rotary is not None:
                q, k = self.rotary(positions, q, k)
        o = ctx.attention(self.layer_name, q, k, v, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))

    def native_record(self, hidden: int) -> tuple | None:
        """The native decode step's record (``native_record``): the kernels this forward
        calls on decode rows (qkv, q/k norm + RoPE, K/V write, decode attention, o)."""
        return attention_record(
            hidden, qkv=self.qkv_proj, o=self.o_proj, heads=self.num_heads,
            kv_heads=self.num_kv_heads, head_dim=self.head_dim, q_size=self.q_size,
            kv_size=self.kv_size, q_norm=self.q_norm, k_norm=self.k_norm, rotary=self.rotary,
            scale=self.scale, gated=False)

    def native_dyn(self, step: Step) -> list[int] | None:
        return step.attention_dyn(self.layer_name)
