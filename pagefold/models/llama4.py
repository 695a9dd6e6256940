"""Llama-4 text (Llama4ForCausalLM): chunked local RoPE attention, NoPE global attention, and
MoE feed-forwards with a shared expert.

Layer ``i`` uses RoPE when ``no_rope_layers[i]`` is 1 (by default all but every 4th layer);
a RoPE layer attends within its chunk only (``attention_chunk_size``: a query at ``p`` sees
keys ``[p - p % C, p]``; cache spec :class:`~pagefold.core.kv_cache_spec.
ChunkedLocalAttentionSpec`), a NoPE layer attends to every earlier token (full attention).
Per layer (transformers' ``Llama4TextDecoderLayer``)::

    q, k, v = q_proj(h), k_proj(h), v_proj(h)           h = input_layernorm(x)
    RoPE layers:  q, k = rope(q), rope(k); then q, k = l2(q), l2(k) when use_qk_norm
                  (l2: the weightless RMS norm over head_dim, eps rms_norm_eps)
    NoPE layers:  q *= 1 + attn_scale * log1p(floor((pos + 1) / floor_scale))
                  when attn_temperature_tuning (pos: the token's absolute position)
    x = x + o_proj(softmax(q k^T / sqrt(head_dim)) v)
    x = x + ffn(post_attention_layernorm(x))

``ffn`` is a SwiGLU MLP of ``intermediate_size_mlp`` on dense layers; on ``moe_layers`` it is
``shared_expert(x) + sum_j expert_{e_j}(x * sigmoid(l_j))`` over the top-k router logits
``l_j`` -- the router score scales each expert's *input* (not its output).

transformers rotates interleaved channel pairs ``(2i, 2i + 1)``; the loader permutes each head's
q/k rows to ``[0, 2, 4, ..., 1, 3, 5, ...]`` so the shelf's rotate-half RoPE does the same
rotation (q.k is unchanged by a permutation applied to both, and so is the L2 norm).
Experts are stored as transformers keeps them, ``gate_up_proj (E, H, 2I)`` and
``down_proj (E, I, H)``, and transposed into :class:`~pagefold.layers.moe.MoEExperts`.

A published Llama-4 checkpoint is ``Llama4ForConditionalGeneration``: the same text weights
under ``language_model.model.*`` / ``language_model.lm_head.*`` (transformers 5 saves them so)
plus a vision tower (``vision_model.*``) and projector (``multi_modal_projector.*``); pagefold
serves its text only (the tower and projector are skipped, image inputs refused), its config's
``text_config`` unwrapped by the registry.

Tensor parallelism: query/KV heads, expert and MLP intermediate columns split (one all-reduce
for routed + shared partials); the router is replicated. Every step takes the module path
(the native CPU decode driver has no record for these layers).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagefold.core.spec_families import llama4_layer_types
from pagefold.distributed.parallel_state import all_reduce
from pagefold.executor.forward_context import ForwardContext
from pagefold.layers.attention.extras import paged_attention_extras
from pagefold.layers.attention_block import head_dim_of, split_heads
from pagefold.layers.decoder_stack import DecoderStack
from pagefold.layers.linear import column_linear, load_into, row_linear
from pagefold.layers.mlp import GatedMLP
from pagefold.layers.moe import MoEExperts
from pagefold.layers.norm import RMSNorm, WeightlessRMSNorm
from pagefold.layers.rotary import RotaryEmbedding
from pagefold.layers.vocab import vocab_embedding
from pagefold.models.llama import CausalLM

logger = logging.getLogger(__name__)

__all__ = ["Llama4ForCausalLM", "Llama4ForConditionalGeneration", "Llama4Moe",
           "interleaved_to_half"]


def interleaved_to_half(head_dim: int) -> torch.Tensor:
    """Row order within a head that turns interleaved RoPE pairs into rotate-half pairs."""
    return torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))


class Llama4Attention(nn.Module):
    def __init__(self, cfg, layer_idx: int, max_positions: int, chunked: bool) -> None:
        super().__init__()
        self.layer_name = f"layers.{layer_idx}"
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.num_heads, self.num_kv_heads, kv_parts = split_heads(heads, kv_heads)
        self.head_dim = d = head_dim_of(cfg)
        self.sizes = [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = column_linear(
            cfg.hidden_size, {"q_proj": heads * d, "k_proj": kv_heads * d, "v_proj": kv_heads * d},
            bias=bias, parts={"k_proj": kv_parts, "v_proj": kv_parts}, what="attention")
        self.o_proj = row_linear(heads * d, cfg.hidden_size, bias=bias, what="attention output")
        use_rope = bool(cfg.no_rope_layers[layer_idx])
        self.rotary = RotaryEmbedding(cfg, d, max_positions) if use_rope else None
        self.qk_norm = (WeightlessRMSNorm(cfg.rms_norm_eps)
                        if use_rope and cfg.use_qk_norm else None)
        self.temperature = not use_rope and bool(cfg.attn_temperature_tuning)
        self.floor_scale, self.attn_scale = float(cfg.floor_scale), float(cfg.attn_scale)
        self.chunk = int(cfg.attention_chunk_size) if chunked else None
        self.scale = d**-0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        if self.qk_norm is not None:
            q, k = self.qk_norm(q), self.qk_norm(k)
        if self.temperature:
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale))
            q = (q * (scales * self.attn_scale + 1.0)[:, None, None]).to(q.dtype)
        if self.chunk is None:
            o = ctx.attention(self.layer_name, q, k, v, self.scale)
        else:
            cache = ctx.cache.attn[self.layer_name]
            meta = ctx.attn_meta[ctx.cache.layer_group[self.layer_name]]
            o = paged_attention_extras(q, k, v, cache, meta, self.scale, chunk=self.chunk)
        return self.o_proj(o.reshape(t, self.sizes[0]))


class Llama4Moe(nn.Module):
    """Top-k sigmoid-scored experts (scores scale the inputs) plus a shared expert."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.router = nn.Linear(cfg.hidden_size, cfg.num_local_experts, bias=False)
        self.experts = MoEExperts(cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size,
                                  what="intermediate_size")
        self.experts.rows_per_token = self.top_k  # see forward: k rows per token
        self.shared_expert = GatedMLP(cfg.hidden_size, cfg.intermediate_size,
                                      act=cfg.hidden_act, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, h = x.shape
        top_v, top_i = torch.topk(self.router(x), self.top_k, dim=-1)
        scores = torch.sigmoid(top_v.float()).to(x.dtype)
        # One expert row per (token, choice), its input pre-scaled; unit output weights.
        rows = (x[:, None, :] * scores[..., None]).reshape(t * self.top_k, h)
        ones = torch.ones(t * self.top_k, 1, dtype=x.dtype, device=x.device)
        routed = self.experts(rows, top_i.reshape(-1, 1), ones).view(t, self.top_k, h).sum(1)
        return all_reduce(self.shared_expert(x) + routed)


class Llama4DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, max_positions: int, chunked: bool) -> None:
        super().__init__()
        self.self_attn = Llama4Attention(cfg, layer_idx, max_positions, chunked)
        if layer_idx in cfg.moe_layers:
            self.feed_forward = Llama4Moe(cfg)
        else:
            self.feed_forward = GatedMLP(cfg.hidden_size, cfg.intermediate_size_mlp,
                                         act=cfg.hidden_act, what="intermediate_size_mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, ctx):
        x = x + self.self_attn(positions, self.input_layernorm(x), ctx)
        return x + self.feed_forward(self.post_attention_layernorm(x))


class Llama4TextModel(DecoderStack):
    """Embeddings -> decoder layers -> final norm (``DecoderStack``, module path only)."""

    native_decode = False

    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__()
        types = llama4_layer_types(cfg)
        self.build_stack(
            len(types),
            lambda i: Llama4DecoderLayer(cfg, i, max_positions, types[i] == "chunked_attention"),
            lambda: vocab_embedding(cfg.vocab_size, cfg.hidden_size),
            lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            hidden_size=cfg.hidden_size, tied=bool(getattr(cfg, "tie_word_embeddings", False)))


class Llama4ForCausalLM(CausalLM):
    """Weights as transformers' Llama4ForCausalLM saves them (``model.*``, ``lm_head``)."""

    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__(cfg, Llama4TextModel(cfg, max_positions))
        self.head_dim = head_dim_of(cfg)

    def _converted(self, weights: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        order = interleaved_to_half(self.head_dim)
        for name, tensor in weights:
            if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
                rows = tensor.shape[0]
                head = tensor.reshape(rows // self.head_dim, self.head_dim, *tensor.shape[1:])
                tensor = head[:, order].reshape(tensor.shape)
            elif name.endswith(".feed_forward.experts.gate_up_proj") or name.endswith(
                    ".feed_forward.experts.down_proj"):
                tensor = tensor.transpose(1, 2).contiguous()
            yield name, tensor

    def load_weights(self, weights) -> None:
        self.check_loaded(load_into(self, self._converted(weights), rename=self.fused_names,
                                    skip_prefixes=self.head_skip_prefixes))


class Llama4ForConditionalGeneration(Llama4ForCausalLM):
    """The published Llama-4 checkpoints, text only: built from the (registry-unwrapped)
    ``text_config``; the text weights renamed to :class:`Llama4ForCausalLM`'s, the vision tower
    and projector skipped (one log line). There is no ``visual`` module, so the engine refuses
    image inputs ("takes no image inputs")."""

    # Checkpoint prefix -> Llama4ForCausalLM's (both layouts transformers has written).
    text_prefixes = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
                     "model.language_model.": "model."}
    vision_prefixes = ("vision_model.", "multi_modal_projector.", "model.vision_model.",
                       "model.multi_modal_projector.")

    def _text_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        skipped = 0
        for name, tensor in weights:
            if name.startswith(self.vision_prefixes):
                skipped += 1
                continue
            for old, new in self.text_prefixes.items():
                if name.startswith(old):
                    name = new + name.removeprefix(old)
                    break
            yield name, tensor
        if skipped:
            logger.info("Llama4ForConditionalGeneration: skipped %d vision tower / projector "
                        "tensors (text only; image inputs are not supported for Llama 4)",
                        skipped)

    def load_weights(self, weights) -> None:
        super().load_weights(self._text_weights(weights))
