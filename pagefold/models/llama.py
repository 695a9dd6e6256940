"""Dense decoder-only transformers: Llama, Qwen2 (qkv bias), Qwen3 (q/k RMSNorm).

Inputs are one flat batch of tokens (no batch dimension): ``input_ids`` (T,), ``positions``
(T,). Attention goes through the ForwardContext, which owns the paged cache.
"""

from __future__ import annotations

import torch
from torch import nn

from pagefold.executor.forward_context import ForwardContext
from pagefold.kernels import dispatch
from pagefold.layers.norm import RMSNorm
from pagefold.layers.rotary import RotaryEmbedding
from pagefold.models.weights import fuse, load_into


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool = False, act: str = "silu") -> None:
        super().__init__()
        self.inter = inter
        self.gate_up_proj = fuse(nn.Linear(hidden, 2 * inter, bias=bias),
                                 {"gate_proj": inter, "up_proj": inter})
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        if act not in ("silu", "gelu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported MLP activation {act!r}")
        self.act = nn.functional.silu if act == "silu" else (
            lambda x: nn.functional.gelu(x, approximate="tanh" if "tanh" in act else "none"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        h = dispatch.silu_and_mul(gate_up) if self.act is nn.functional.silu else None
        if h is None:
            gate, up = gate_up.split(self.inter, dim=-1)
            h = self.act(gate) * up
        return self.down_proj(h)


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx: int, *, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 max_positions: int) -> None:
        super().__init__()
        self.layer_name = f"layers.{layer_idx}"
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(cfg)
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_size, self.kv_size = q, kv
        self.qkv_proj = fuse(nn.Linear(cfg.hidden_size, q + 2 * kv, bias=qkv_bias),
                             {"q_proj": q, "k_proj": kv, "v_proj": kv})
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.rotary = RotaryEmbedding(cfg, self.head_dim, max_positions)
        self.scale = self.head_dim**-0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        # One pass for q/k norm + RoPE when the compiled kernel takes it; same roundings.
        qk = dispatch.qk_norm_rope(
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
            q, k = self.rotary(positions, q, k)
        o = ctx.attention(self.layer_name, q, k, v, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, **attn_kw) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, **attn_kw)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size,
                            bias=getattr(cfg, "mlp_bias", False),
                            act=getattr(cfg, "hidden_act", "silu"))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, ctx, residual=None):
        """Returns ``(mlp output, residual)``: the caller adds them (the next layer's fused
        add + norm does), so ``x + residual`` is this layer's output hidden state."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, ctx)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg, max_positions: int, **attn_kw) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, max_positions=max_positions, **attn_kw)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, ctx):
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, ctx, residual)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm(x, residual)[0]


class CausalLM(nn.Module):
    """Shared top: embeddings -> decoder -> final norm -> lm_head (tied or not)."""

    # Checkpoint sub-module -> fused parameter name.
    fused_names = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                   "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}

    def __init__(self, cfg, model: nn.Module) -> None:
        super().__init__()
        self.config = cfg
        self.model = model
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights) -> None:
        skip = ("lm_head.",) if self.tied else ()
        loaded = load_into(self, weights, rename=self.fused_names, skip_prefixes=skip)
        expected = {n for n, _ in self.named_parameters()}
        got = {n.split(":")[0] for n in loaded}
        missing = sorted(expected - got - ({"lm_head.weight"} if self.tied else set()))
        if missing:
            raise ValueError(f"checkpoint lacks weights for: {missing[:8]}")


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg, max_positions: int) -> None:
        bias = bool(getattr(cfg, "attention_bias", False))
        super().__init__(cfg, DecoderModel(cfg, max_positions, qkv_bias=bias, o_bias=bias,
                                           qk_norm=False))


class Qwen2ForCausalLM(CausalLM):
    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__(cfg, DecoderModel(cfg, max_positions, qkv_bias=True, o_bias=False,
                                           qk_norm=False))


class Qwen3ForCausalLM(CausalLM):
    def __init__(self, cfg, max_positions: int) -> None:
        bias = bool(getattr(cfg, "attention_bias", False))
        super().__init__(cfg, DecoderModel(cfg, max_positions, qkv_bias=bias, o_bias=bias,
                                           qk_norm=True))
