"""Mamba-2 (Mamba2ForCausalLM): an SSM-only stack, no attention and no positional encoding.

Each block is ``x + mixer(norm(x))`` with the Mamba-2 mixer shared with the hybrids
(:class:`~pagefold.models.mamba2_hybrid.Mamba2Mixer`); a final RMSNorm and the LM head follow.
The cache pool holds only states, so prefix caching works through state checkpoints alone.
Weights live under ``backbone.`` (older checkpoints name the embedding ``backbone.embedding``).
``residual_in_fp32`` keeps the residual stream in float32 between blocks, as transformers does.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagefold.distributed.parallel_state import pp_is_last
from pagefold.executor.forward_context import ForwardContext
from pagefold.layers.decoder_stack import AbsentPart, DecoderStack
from pagefold.layers.norm import RMSNorm
from pagefold.layers.vocab import gather_logits, lm_head_linear, vocab_embedding
from pagefold.models.mamba2_hybrid import Mamba2Config, Mamba2Mixer, dt_limit
from pagefold.models.weights import load_into

__all__ = ["Mamba2ForCausalLM", "mamba2_mixer_config"]


def mamba2_mixer_config(cfg) -> Mamba2Config:
    """Mamba2Config's field names -> the shared mixer's shapes."""
    return Mamba2Config(
        hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, head_dim=cfg.head_dim,
        n_groups=cfg.n_groups, state_size=cfg.state_size, conv_kernel=cfg.conv_kernel,
        chunk_size=cfg.chunk_size, eps=cfg.layer_norm_epsilon,
        dt_limit=dt_limit(cfg), proj_bias=bool(cfg.use_bias),
        conv_bias=bool(cfg.use_conv_bias), activation=getattr(cfg, "hidden_act", "silu"))


class Mamba2Block(nn.Module):
    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__()
        self.residual_in_fp32 = bool(getattr(cfg, "residual_in_fp32", True))
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.mixer = Mamba2Mixer(mamba2_mixer_config(cfg), f"layers.{layer_idx}")

    def native_blocks(self) -> list[tuple[nn.Module, nn.Module]] | None:
        """The native decode step's block (norm, mixer); None with a float32 residual stream
        (``residual_in_fp32``), which the driver's bf16 stream is not."""
        return None if self.residual_in_fp32 else [(self.norm, self.mixer)]

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.mixer(self.norm(x.to(self.norm.weight.dtype)), ctx)
        residual = x.float() if self.residual_in_fp32 else x
        return residual + h


class StateOnlyStack(DecoderStack):
    """The state-only backbones' stack: blocks take ``(x, ctx)``; the stream is float32 after
    the first block with ``residual_in_fp32`` (what pipeline stages hand on); the final norm
    takes it back to the model dtype. No RoPE: the positions are never read (the native step
    takes the token ids in their place)."""

    def init_state_stack(self, cfg, make_block) -> None:
        self.build_stack(
            cfg.num_hidden_layers, make_block,
            lambda: vocab_embedding(cfg.vocab_size, cfg.hidden_size),
            lambda: RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon),
            hidden_size=cfg.hidden_size, tied=bool(getattr(cfg, "tie_word_embeddings", False)),
            embed_name="embeddings", norm_name="norm_f")
        if getattr(cfg, "residual_in_fp32", True):
            self.hidden_dtype = torch.float32

    def run_layer(self, layer, positions, x, residual, ctx):
        return layer(x, ctx), None

    def final_norm(self, x, residual):
        return self.norm_f(x.to(self.norm_f.weight.dtype))


class Mamba2Model(StateOnlyStack):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.init_state_stack(cfg, lambda i: Mamba2Block(cfg, i))

class Mamba2ForCausalLM(nn.Module):
    """``forward(input_ids (T,), positions (T,), ctx) -> (T, hidden)`` (positions unused).

    The state-only stacks share this shell (``backbone.`` weights, optionally tied head);
    a subclass names its backbone in ``backbone_class`` (built from the config alone)."""

    backbone_class: type[nn.Module] = Mamba2Model

    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__()
        del max_positions
        self.config = cfg
        self.backbone = self.backbone_class(cfg)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.vocab_size = cfg.vocab_size
        if not pp_is_last():  # an earlier pipeline stage has no head
            self.lm_head = AbsentPart()
            return
        self.lm_head = lm_head_linear(cfg.hidden_size, cfg.vocab_size)
        if self.tied:
            self.lm_head.weight = self.backbone.embeddings.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        return self.backbone(input_ids, input_ids, ctx)  # ids stand in for positions

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_logits(self.lm_head(hidden), self.vocab_size).float()

    @staticmethod
    def _renamed(weights: Iterable[tuple[str, torch.Tensor]]):
        for name, tensor in weights:
            if name.startswith("model."):
                name = "backbone." + name[len("model."):]
            yield name.replace("backbone.embedding.", "backbone.embeddings."), tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skip = ("lm_head.",) if self.tied else ()
        loaded = load_into(self, self._renamed(weights), skip_prefixes=skip)
        got = {n.split(":")[0] for n in loaded}
        expected = {n for n, _ in self.named_parameters()}
        if self.tied:
            expected.discard("lm_head.weight")
        missing = sorted(expected - got)
        if missing:
            raise ValueError(f"checkpoint lacks weights for: {missing[:8]}")
