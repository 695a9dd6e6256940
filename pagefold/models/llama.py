"""Dense decoder-only transformers: Llama, Qwen2 (qkv bias), Qwen3 (q/k RMSNorm).

Inputs are one flat batch of tokens (no batch dimension): ``input_ids`` (T,), ``positions``
(T,). Attention goes through the ForwardContext, which owns the paged cache.
"""

from __future__ import annotations

import torch
from torch import nn

from pagefold.executor.forward_context import ForwardContext
from pagefold.layers.attention_block import GQAAttention, head_dim_of
from pagefold.layers.decoder_stack import DecoderStack
from pagefold.layers.linear import load_into
from pagefold.layers.lm_head import CausalLMHead
from pagefold.layers.mlp import GatedMLP
from pagefold.layers.norm import RMSNorm
from pagefold.layers.vocab import vocab_embedding

# Shelf parts, importable from here as before.
__all__ = ["Attention", "CausalLM", "DecoderLayer", "DecoderModel", "GatedMLP", "head_dim_of",
           "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]


class Attention(GQAAttention):
    """Llama / Qwen attention: the shelf's GQA block with full RoPE."""


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

    def native_blocks(self) -> list[tuple[nn.Module, nn.Module]]:
        """The native decode step's blocks: (input norm, attention), (post norm, MLP)."""
        return [(self.input_layernorm, self.self_attn), (self.post_attention_layernorm, self.mlp)]


class DecoderModel(DecoderStack):
    """Embeddings -> decoder layers (a residual stream) -> final norm (``DecoderStack``)."""

    residual_stream = True

    def __init__(self, cfg, max_positions: int, **attn_kw) -> None:
        super().__init__()
        self.build_stack(
            cfg.num_hidden_layers,
            lambda i: DecoderLayer(cfg, i, max_positions=max_positions, **attn_kw),
            lambda: vocab_embedding(cfg.vocab_size, cfg.hidden_size),
            lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            hidden_size=cfg.hidden_size, tied=bool(getattr(cfg, "tie_word_embeddings", False)))


class CausalLM(CausalLMHead):
    """Shared top: embeddings -> decoder -> final norm -> lm_head (tied or not)."""

    # Checkpoint sub-module -> fused parameter name.
    fused_names = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                   "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}

    def __init__(self, cfg, model: nn.Module) -> None:
        super().__init__()
        self.config = cfg
        self.model = model
        self.init_head(cfg, self.model.embed_tokens)

    def forward(self, input_ids, positions, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    # The step is the decoder stack's alone (CausalLMHead.greedy_run may then make it in one
    # compiled call); a subclass overriding forward loses this mark with the function.
    forward.pf_stack_only = True  # type: ignore[attr-defined]

    def load_weights(self, weights) -> None:
        self.check_loaded(load_into(self, weights, rename=self.fused_names,
                                    skip_prefixes=self.head_skip_prefixes))


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
