"""MiniMax-Text-01 / M1 (MiniMaxForCausalLM): lightning attention, full attention, MoE.

Layer (transformers' MiniMaxDecoderLayer; note the residual is the *normed* input)::

    h = input_norm(x);            h = alpha_a * h + beta_a * attn(h)
    h = post_attention_norm(h);   y = alpha_m * h + beta_m * moe(h)

with (alpha_a, beta_a) the linear- or full-attention factors of the layer's kind.

* Lightning attention layer ``i``: ``q, k, v = split_per_head(silu(qkv_proj(x)))``, a decayed
  linear attention (:mod:`pagefold.ops.lightning.reference`) with per-head rate
  ``s_h = base^(h+1) * (1 - i / (L - 1 + 1e-5) + 1e-5)``, ``base = 2^(-8/H)``; then
  ``out_proj(sigmoid(output_gate(x)) * RMSNorm(o))``. Its state, ``StateSpec(kind="lightning")``
  with one ``kv (H, D, D)`` component, lives in the pool like any state.
* Full attention: GQA with RoPE (K/V pages); MoE: softmax top-k, renormalised, SwiGLU experts
  (checkpoint names ``block_sparse_moe.experts.{e}.w1/w3/w2``).

Tensor parallelism: lightning heads split (``qkv_proj`` rows are per head ``[q | k | v]``, so
a rank's heads are one run of rows; its decay rates and ``kv`` states go with them); the
output norm spans all heads, so its statistics are summed over the ranks (one all-reduce);
MoE experts split their intermediate dimension (``layers/moe.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagefold.core.spec_families import minimax_layer_types
from pagefold.distributed.parallel_state import all_reduce, tp_rank, tp_size
from pagefold.executor.forward_context import ForwardContext
from pagefold.layers.attention_block import GQAAttention
from pagefold.layers.decoder_stack import DecoderStack
from pagefold.layers.linear import column_linear, row_linear, shard_rows
from pagefold.layers.moe import SparseMoeBlock
from pagefold.layers.norm import RMSNorm
from pagefold.layers.vocab import vocab_embedding
from pagefold.models.qwen3_5 import HybridCausalLM
from pagefold.ops.lightning import lightning

__all__ = ["LightningAttention", "MiniMaxForCausalLM", "lightning_slopes"]

_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_DECAY_BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")


def lightning_slopes(num_heads: int, layer_idx: int, num_layers: int) -> torch.Tensor:
    """(H,) float32 decay rates of layer ``layer_idx``, as transformers computes them."""
    base = 1 / (2 ** (8 / num_heads))
    rate = base ** (torch.arange(num_heads) + 1)
    return rate * (1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5)


class _RankSpanningRMSNorm(RMSNorm):
    """RMSNorm over a vector whose channels are split over the ranks: the squares are summed
    over them (one all-reduce); this rank's weight slice scales its channels."""

    def __init__(self, local_dim: int, full_dim: int, eps: float) -> None:
        super().__init__(local_dim, eps)
        self.full_dim = full_dim
        shard_rows(self.weight, [full_dim], "num_attention_heads")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        assert residual is None
        h = x.float()
        sq = all_reduce(h.pow(2).sum(-1, keepdim=True))
        return self.weight * (h * torch.rsqrt(sq / self.full_dim + self.eps)).to(x.dtype)


class LightningAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int, chunk_size: int = 64) -> None:
        super().__init__()
        self.layer_name = f"layers.{layer_idx}"
        heads = cfg.num_attention_heads
        if heads % tp_size():
            raise ValueError(f"num_attention_heads ({heads}) is not divisible by "
                             f"tensor_parallel_size {tp_size()}")
        self.num_heads = h = heads // tp_size()  # this rank's heads
        self.head_dim = d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.chunk_size = chunk_size
        self.qkv_proj = column_linear(cfg.hidden_size, 3 * heads * d, bias=False,
                                      what="lightning attention")
        self.output_gate = column_linear(cfg.hidden_size, heads * d, bias=False,
                                         what="lightning attention")
        self.out_proj = row_linear(heads * d, cfg.hidden_size, bias=False,
                                   what="lightning attention output")
        # transformers leaves this norm's eps at its default
        self.norm = (RMSNorm(h * d, 1e-6) if tp_size() == 1
                     else _RankSpanningRMSNorm(h * d, heads * d, 1e-6))
        slope = lightning_slopes(heads, layer_idx, cfg.num_hidden_layers)
        self.register_buffer("slope", slope[tp_rank() * h : (tp_rank() + 1) * h].clone(),
                             persistent=False)
        if cfg.hidden_act not in ("silu", "swish"):
            raise ValueError(f"unsupported MiniMax activation {cfg.hidden_act!r}")

    def forward(self, positions, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        q, k, v = F.silu(self.qkv_proj(x)).view(t, h, 3 * d).split(d, dim=-1)
        _, meta = ctx.state(self.layer_name)
        state = ctx.load_states(self.layer_name)["kv"]
        # A verify step keeps the state after every token: the commit selects the accepted one.
        o, state = lightning(q, k, v, self.slope, state, meta.cu_seqlens,
                             decode=meta.all_decode, verify=ctx.verify,
                             chunk_size=self.chunk_size)
        if ctx.verify:
            ctx.store_token_states(self.layer_name, {"kv": state})
        else:
            ctx.store_states(self.layer_name, {"kv": state})
        o = self.norm(o.to(x.dtype).reshape(t, h * d))
        return self.out_proj(torch.sigmoid(self.output_gate(x)) * o)


class MiniMaxDecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, kind: str, max_positions: int) -> None:
        super().__init__()
        if kind == "linear_attention":
            self.self_attn = LightningAttention(cfg, layer_idx)
            self.alpha, self.beta = cfg.linear_attn_alpha_factor, cfg.linear_attn_beta_factor
        else:
            self.self_attn = GQAAttention(cfg, layer_idx, qkv_bias=False, o_bias=False,
                                       qk_norm=False, max_positions=max_positions)
            self.alpha, self.beta = cfg.full_attn_alpha_factor, cfg.full_attn_beta_factor
        self.mlp = SparseMoeBlock(cfg.hidden_size, cfg.num_local_experts,
                                  cfg.num_experts_per_tok, cfg.intermediate_size,
                                  norm_topk_prob=True, act=cfg.hidden_act,
                                  what="intermediate_size")
        self.mlp_alpha, self.mlp_beta = cfg.mlp_alpha_factor, cfg.mlp_beta_factor
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, ctx):
        h = self.input_layernorm(x)
        h = h * self.alpha + self.self_attn(positions, h, ctx) * self.beta
        h = self.post_attention_layernorm(h)
        return h * self.mlp_alpha + self.mlp(h) * self.mlp_beta


class MiniMaxModel(DecoderStack):
    """Embeddings -> decoder layers -> final norm (``DecoderStack``, module path only)."""

    native_decode = False

    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__()
        kinds = minimax_layer_types(cfg)
        self.build_stack(
            len(kinds), lambda i: MiniMaxDecoderLayer(cfg, i, kinds[i], max_positions),
            lambda: vocab_embedding(cfg.vocab_size, cfg.hidden_size),
            lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            hidden_size=cfg.hidden_size, tied=bool(getattr(cfg, "tie_word_embeddings", False)))

class MiniMaxForCausalLM(HybridCausalLM):
    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__(cfg, MiniMaxModel(cfg, max_positions))

    def convert_weight(self, name: str, tensor: torch.Tensor):
        if name.rsplit(".", 1)[-1] in _DECAY_BUFFERS:
            return  # recomputed from the config
        name = name.replace(".block_sparse_moe.", ".mlp.")
        parts = name.split(".")
        if len(parts) > 2 and parts[-3].isdigit() and parts[-2] in _EXPERT_PROJ:
            parts[-2] = _EXPERT_PROJ[parts[-2]]
            name = ".".join(parts)
        yield name, tensor
