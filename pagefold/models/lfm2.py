"""LFM2 (Lfm2ForCausalLM): gated short-convolution layers and GQA attention layers.

Per layer: ``h = x + op(operator_norm(x))``, ``y = h + ffn(ffn_norm(h))``, where ``op`` is
attention (q/k RMSNorm per head, RoPE) or the short conv::

    B, C, x = split(in_proj(h), 3)                 (T, hidden) each
    y = out_proj(C * conv1d(B * x))                depthwise causal conv, kernel L, no activation

The conv layer's whole per-request state is its last ``L - 1`` inputs ``B * x``: a
``StateSpec(kind="shortconv")`` with one ``conv (hidden, L - 1)`` component, held in the one
pool like any state (checkpoints, forks, swap and recompute copy its page). The final norm is
called ``embedding_norm`` in checkpoints. The MLP width follows transformers' auto-adjust rule.

Tensor parallelism: attention heads, MLP width and the short conv's channels split over the
ranks (the conv is depthwise and B, C, x are per channel, so a rank's channels need nothing
from the others: its state is ``conv (hidden / tp, L - 1)``, as the planner sizes it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagefold.core.spec_families import lfm2_layer_types
from pagefold.executor.forward_context import ForwardContext
from pagefold.layers.attention_block import split_heads
from pagefold.layers.decoder_stack import DecoderStack
from pagefold.layers.linear import column_linear, row_linear, shard_rows
from pagefold.layers.norm import RMSNorm
from pagefold.layers.rotary import RotaryEmbedding
from pagefold.layers.vocab import vocab_embedding
from pagefold.models.llama import CausalLM
from pagefold.ops.conv1d import causal_conv1d

__all__ = ["Lfm2ForCausalLM", "Lfm2ShortConv", "lfm2_ffn_width"]


def lfm2_ffn_width(cfg) -> int:
    """transformers' Lfm2MLP width: 2/3 of intermediate_size, times the multiplier, rounded up
    to ``block_multiple_of`` (when ``block_auto_adjust_ff_dim``)."""
    width = cfg.intermediate_size
    if getattr(cfg, "block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        mult = getattr(cfg, "block_ffn_dim_multiplier", 1.0)
        if mult is not None:
            width = int(mult * width)
            m = cfg.block_multiple_of
            width = m * ((width + m - 1) // m)
    return width


class Lfm2MLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        width, what = lfm2_ffn_width(cfg), "LFM2 MLP width (intermediate_size, adjusted)"
        self.w1 = column_linear(cfg.hidden_size, width, bias=False, what=what)
        self.w3 = column_linear(cfg.hidden_size, width, bias=False, what=what)
        self.w2 = row_linear(width, cfg.hidden_size, bias=False, what=what)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Lfm2Attention(nn.Module):
    def __init__(self, cfg, layer_idx: int, max_positions: int) -> None:
        super().__init__()
        self.layer_name = f"layers.{layer_idx}"
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.num_heads, self.num_kv_heads, kv_parts = split_heads(heads, kv_heads)
        self.head_dim = d = cfg.hidden_size // heads
        self.sizes = [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]
        self.qkv_proj = column_linear(
            cfg.hidden_size, {"q_proj": heads * d, "k_proj": kv_heads * d, "v_proj": kv_heads * d},
            bias=False, parts={"k_proj": kv_parts, "v_proj": kv_parts}, what="attention")
        self.out_proj = row_linear(heads * d, cfg.hidden_size, bias=False,
                                   what="attention output")
        self.q_layernorm = RMSNorm(self.head_dim, cfg.norm_eps)
        self.k_layernorm = RMSNorm(self.head_dim, cfg.norm_eps)
        self.rotary = RotaryEmbedding(cfg, self.head_dim, max_positions)
        self.scale = self.head_dim**-0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = self.q_layernorm(q.reshape(t, self.num_heads, self.head_dim))
        k = self.k_layernorm(k.reshape(t, self.num_kv_heads, self.head_dim))
        q, k = self.rotary(positions, q, k)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        o = ctx.attention(self.layer_name, q.contiguous(), k.contiguous(), v.contiguous(),
                          self.scale)
        return self.out_proj(o.reshape(t, self.sizes[0]))


class Lfm2ShortConv(nn.Module):
    """Gated short conv over a flat token batch; its state is the layer ``layers.{i}``."""

    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__()
        self.layer_name = f"layers.{layer_idx}"
        h, k, bias = cfg.hidden_size, cfg.conv_L_cache, bool(cfg.conv_bias)
        self.kernel = k
        # in_proj rows B | C | x, each cut over the ranks; the conv's channels likewise.
        self.in_proj = column_linear(h, [h, h, h], bias=bias, what="LFM2 conv channels")
        local = self.in_proj.out_features // 3
        self.conv = nn.Conv1d(local, local, k, groups=local, bias=bias, padding=k - 1)
        for p in self.conv.parameters():
            shard_rows(p, [h], "LFM2 conv channels")
        self.out_proj = row_linear(h, h, bias=bias, what="LFM2 conv channels")

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        b, c, xs = self.in_proj(x).chunk(3, dim=-1)
        bx = b * xs
        _, meta = ctx.state(self.layer_name)
        state = ctx.load_states(self.layer_name)["conv"]
        weight = self.conv.weight.view(self.conv.weight.shape[0], self.kernel)
        # A verify step keeps the window after every token: the commit selects the accepted one.
        y, state = causal_conv1d(bx, weight, self.conv.bias, state, meta.cu_seqlens,
                                 activation=None, decode=meta.all_decode, verify=ctx.verify)
        if ctx.verify:
            ctx.store_token_states(self.layer_name, {"conv": state})
        else:
            ctx.store_states(self.layer_name, {"conv": state})
        return self.out_proj(c * y)


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, kind: str, max_positions: int) -> None:
        super().__init__()
        self.is_attention = kind == "full_attention"
        if self.is_attention:
            self.self_attn = Lfm2Attention(cfg, layer_idx, max_positions)
        else:
            self.conv = Lfm2ShortConv(cfg, layer_idx)
        self.feed_forward = Lfm2MLP(cfg)
        self.operator_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, positions, x, ctx):
        h = self.operator_norm(x)
        h = self.self_attn(positions, h, ctx) if self.is_attention else self.conv(h, ctx)
        x = x + h
        return x + self.feed_forward(self.ffn_norm(x))


class Lfm2Model(DecoderStack):
    """Embeddings -> attention / short-conv layers -> final norm (named ``embedding_norm`` in
    the checkpoints) (``DecoderStack``, module path only)."""

    native_decode = False

    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__()
        kinds = lfm2_layer_types(cfg)
        self.build_stack(
            len(kinds), lambda i: Lfm2DecoderLayer(cfg, i, kinds[i], max_positions),
            lambda: vocab_embedding(cfg.vocab_size, cfg.hidden_size),
            lambda: RMSNorm(cfg.hidden_size, cfg.norm_eps),
            hidden_size=cfg.hidden_size, tied=bool(getattr(cfg, "tie_word_embeddings", False)),
            norm_name="embedding_norm")

class Lfm2ForCausalLM(CausalLM):
    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__(cfg, Lfm2Model(cfg, max_positions))
