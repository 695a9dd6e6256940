"""Gemma 3 text (Gemma3ForCausalLM): sliding-window and full attention layers (5:1 by default).

Per layer (transformers' Gemma3DecoderLayer)::

    h = x + post_attention_norm(attn(input_norm(x)))
    y = h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))

* Norms are zero-centred RMSNorms (``x * (1 + w)``), also on q and k per head.
* Embeddings are multiplied by ``sqrt(hidden_size)`` (rounded to the weight dtype).
* Attention scale is ``query_pre_attn_scalar ** -0.5``; sliding layers attend to the last
  ``sliding_window`` keys and use the local RoPE (``rope_parameters["sliding_attention"]``),
  full layers the global one. The cache puts sliding layers in a sliding-window group, whose
  old pages go back to the pool.
* MLP: ``down(gelu_tanh(gate(x)) * up(x))``.
* ``final_logit_softcapping`` c: ``logits = c * tanh(logits / c)``. transformers' Gemma 3 does
  not apply ``attn_logit_softcapping`` (its attention never receives it), so neither do we.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from pagefold.core.spec_families import gemma3_layer_types
from pagefold.executor.forward_context import ForwardContext
from pagefold.layers.attention_block import head_dim_of, split_heads
from pagefold.layers.decoder_stack import DecoderStack
from pagefold.layers.linear import column_linear, load_into, row_linear
from pagefold.layers.mlp import GatedMLP
from pagefold.layers.norm import RMSNorm
from pagefold.layers.rotary import RotaryEmbedding
from pagefold.layers.vocab import gather_logits, vocab_embedding
from pagefold.models.llama import CausalLM
from pagefold.models.siglip import Gemma3VisionEncoder

logger = logging.getLogger(__name__)

__all__ = ["Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "LayerTypeRotary"]


class LayerTypeRotary(RotaryEmbedding):
    """RoPE whose parameters are ``cfg.rope_parameters[layer_type]`` (Gemma 3 nests them per
    layer type); scaled types come from transformers' own initialisers, as in
    :func:`pagefold.layers.rotary.inv_freq_from_config`."""

    def __init__(self, cfg, head_dim: int, max_positions: int, layer_type: str) -> None:
        nn.Module.__init__(self)
        self.head_dim = self.rotary_dim = head_dim
        params = (getattr(cfg, "rope_parameters", None) or {}).get(layer_type) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            theta = params.get("rope_theta", 10000.0)
            inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                                   / head_dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, None, layer_type=layer_type)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * float(scaling), persistent=False)
        self.register_buffer("sin", emb.sin() * float(scaling), persistent=False)


class Gemma3Attention(nn.Module):
    def __init__(self, cfg, layer_idx: int, layer_type: str, max_positions: int) -> None:
        super().__init__()
        self.layer_name = f"layers.{layer_idx}"
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        # This rank's heads (KV heads fewer than ranks are replicated).
        self.num_heads, self.num_kv_heads, kv_parts = split_heads(heads, kv_heads)
        self.head_dim = d = head_dim_of(cfg)
        self.sizes = [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = column_linear(
            cfg.hidden_size, {"q_proj": heads * d, "k_proj": kv_heads * d, "v_proj": kv_heads * d},
            bias=bias, parts={"k_proj": kv_parts, "v_proj": kv_parts}, what="attention")
        self.o_proj = row_linear(heads * d, cfg.hidden_size, bias=bias, what="attention output")
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, zero_centered=True)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, zero_centered=True)
        self.rotary = LayerTypeRotary(cfg, self.head_dim, max_positions, layer_type)
        self.scale = float(cfg.query_pre_attn_scalar) ** -0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim))
        q, k = self.rotary(positions, q, k)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        o = ctx.attention(self.layer_name, q.contiguous(), k.contiguous(), v.contiguous(),
                          self.scale)
        return self.o_proj(o.reshape(t, self.sizes[0]))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, layer_type: str, max_positions: int) -> None:
        super().__init__()
        eps, hidden = cfg.rms_norm_eps, cfg.hidden_size
        self.self_attn = Gemma3Attention(cfg, layer_idx, layer_type, max_positions)
        self.mlp = GatedMLP(hidden, cfg.intermediate_size,
                            act=getattr(cfg, "hidden_activation", "gelu_pytorch_tanh"))
        self.input_layernorm = RMSNorm(hidden, eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps, zero_centered=True)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, zero_centered=True)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, zero_centered=True)

    def forward(self, positions, x, ctx):
        h = self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), ctx))
        x = x + h
        h = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x + h


class Gemma3Model(DecoderStack):
    """Scaled embeddings -> decoder layers -> final zero-centred norm (``DecoderStack``,
    module path only)."""

    native_decode = False

    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__()
        self.embed_scale = math.sqrt(cfg.hidden_size)
        types = gemma3_layer_types(cfg)
        self.build_stack(
            len(types), lambda i: Gemma3DecoderLayer(cfg, i, types[i], max_positions),
            lambda: vocab_embedding(cfg.vocab_size, cfg.hidden_size),
            lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True),
            hidden_size=cfg.hidden_size, tied=bool(getattr(cfg, "tie_word_embeddings", False)))

    def embed(self, input_ids):
        w = self.embed_tokens.weight
        return self.embed_tokens(input_ids) * torch.tensor(self.embed_scale, dtype=w.dtype)

    def embed_inputs(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed(input_ids)
        if ctx.mm_embeds is not None:  # image soft tokens take the encoder's rows (unscaled)
            rows, embeds = ctx.mm_embeds
            x = x.index_copy(0, rows, embeds.to(x.dtype))
        return x

class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 text model; weights as transformers names them (``model.``, ``lm_head.``)."""

    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__(cfg, Gemma3Model(cfg, max_positions))
        self.softcap = getattr(cfg, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = gather_logits(self.lm_head(hidden), self.vocab_size)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()

    def load_weights(self, weights) -> None:
        # Multimodal checkpoints keep the text model under model.language_model. (transformers
        # 5) or language_model.model. (the published layout); the vision parts are skipped.
        super().load_weights(
            (n, t) for n, t in map(_text_name, weights)
            if not n.startswith(("vision_tower.", "multi_modal_projector.")))


_RENAMES = (("model.language_model.", "model."), ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."), ("model.vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."))


def _text_name(item: tuple[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
    """A Gemma 3 checkpoint tensor under the names this module uses: text weights under
    ``model.`` / ``lm_head.``, the vision parts under ``vision_tower.`` (the published
    ``vision_tower.vision_model.`` level dropped) and ``multi_modal_projector.``."""
    name, tensor = item
    for old, new in _RENAMES:
        if name.startswith(old):
            name = new + name[len(old):]
            break
    if name.startswith("vision_tower.vision_model."):
        name = "vision_tower." + name[len("vision_tower.vision_model."):]
    return name, tensor


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3 with images: the text model of :class:`Gemma3ForCausalLM` and, when the
    checkpoint's config has a ``vision_config``, the SigLIP tower and projector
    (``self.visual``, :mod:`pagefold.models.siglip`). An image's soft tokens take the encoder's
    rows and attend to each other both ways (``MultiModalInputs.bidirectional``: the runner
    marks their rows, the attention op unmasks them). A checkpoint whose vision weights are
    incomplete is served as text only."""

    takes_mm_config = True

    def __init__(self, cfg, max_positions: int, mm_config=None) -> None:
        super().__init__(cfg, max_positions)
        vc = getattr(mm_config, "vision_config", None)
        self.visual = (Gemma3VisionEncoder(vc, cfg.hidden_size,
                                           int(mm_config.mm_tokens_per_image))
                       if vc is not None else None)

    def encode_images(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]
                      ) -> torch.Tensor:
        """(N, C, S, S) or (C, S, S) pixels -> their soft tokens' embeddings (the grid is
        fixed by the tower: ``grids`` only mirror the request's)."""
        return self.visual(pixels)

    def load_weights(self, weights) -> None:
        if self.visual is None:
            return super().load_weights(weights)
        vision: list[tuple[str, torch.Tensor]] = []

        def text_only(ws):
            for name, tensor in map(_text_name, ws):
                if name.startswith(("vision_tower.", "multi_modal_projector.")):
                    vision.append((name, tensor))
                else:
                    yield name, tensor

        for p in self.visual.parameters():
            p.optional = True  # checked below, not by check_loaded
        super().load_weights(text_only(weights))
        got = load_into(self.visual, vision)
        missing = [n for n, _ in self.visual.named_parameters() if n not in got]
        if missing:
            logger.warning("the checkpoint's vision tower lacks %s: serving text only",
                           missing[:4])
            self.visual = None
