"""Multi-token prediction (MTP) speculation for Qwen3.5 / Qwen3-Next checkpoints that ship
``mtp.*`` tensors (``mtp_num_hidden_layers`` / ``num_nextn_predict_layers`` >= 1 in the
config; transformers drops these tensors on load, :func:`load_mtp` reads them).

The MTP block (:class:`MultiTokenPredictor`): for the row at position ``p`` it takes the
target's final hidden state ``h_p`` (after the final norm) and the embedding of the *next*
token ``t_{p+1}``; each goes through its own zero-centred RMSNorm (``pre_fc_norm_hidden``,
``pre_fc_norm_embedding``), ``fc`` maps ``[embedding | hidden]`` (2H) to H, one decoder layer
of the target's kind with full attention (its own KV cache, ``mtp.layers.{i}`` in the pool)
runs at position ``p``, a final norm gives ``g_p`` and the target's (shared) ``lm_head``
gives the logits for ``t_{p+2}``. Embeddings and head are the target's.

:class:`MtpProposer` drafts with it through the proposer shared with EAGLE
(:class:`~pagefold.spec_decode.hidden_proposer.HiddenStateProposer`, whose docstring states
the invariant: the MTP layer computes exactly the target's positions, so cached blocks hold
valid MTP KV).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch
from torch import nn

from pagefold.core.kv_cache_spec import LayerSpec, is_attention
from pagefold.executor.forward_context import ForwardContext
from pagefold.layers.linear import load_into
from pagefold.layers.moe import ExpertWeightRouter
from pagefold.layers.norm import RMSNorm
from pagefold.models.qwen3_5 import HybridCausalLM, HybridDecoderLayer
from pagefold.models.qwen3_next import next_mlp
from pagefold.models.weights import iter_weights
from pagefold.spec_decode.aux_hidden import target_embedding
from pagefold.spec_decode.hidden_proposer import HiddenStateProposer

__all__ = ["MTP_PREFIX", "MtpProposer", "MultiTokenPredictor", "load_mtp", "mtp_layer_specs",
           "num_mtp_layers"]

logger = logging.getLogger("pagefold")

MTP_PREFIX = "mtp."


def num_mtp_layers(cfg) -> int:
    return int(getattr(cfg, "mtp_num_hidden_layers", 0)
               or getattr(cfg, "num_nextn_predict_layers", 0) or 0)


def mtp_layer_specs(target: dict[str, LayerSpec], cfg) -> dict[str, LayerSpec]:
    """One full-attention cache entry per MTP layer, with the target's attention spec."""
    attn = next((s for s in target.values() if is_attention(s)
                 and getattr(s, "window", None) is None), None)
    if attn is None:
        raise ValueError("speculative method 'mtp' needs a target with full attention layers")
    return {f"{MTP_PREFIX}layers.{i}": attn for i in range(num_mtp_layers(cfg))}


class MultiTokenPredictor(nn.Module):
    """The ``mtp.*`` block (see the module docstring); ``forward`` returns ``g`` (T, H)."""

    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__()
        n = num_mtp_layers(cfg)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        # The MTP layers come after the target's in the layer numbering, all full attention.
        lcfg = copy.deepcopy(cfg)
        lcfg.layer_types = list(cfg.layer_types[: cfg.num_hidden_layers]) + [
            "full_attention"] * n
        first = cfg.num_hidden_layers
        self.layers = nn.ModuleList(
            HybridDecoderLayer(lcfg, first + i, max_positions, next_mlp(lcfg, first + i))
            for i in range(n))
        for i, layer in enumerate(self.layers):
            layer.self_attn.layer_name = f"{MTP_PREFIX}layers.{i}"
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, eps, zero_centered=True)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, zero_centered=True)
        self.norm = RMSNorm(h, eps, zero_centered=True)
        # The target's embedding lookup (a function, so the embeddings stay the target's).
        self.embed = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                *, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        e = self.pre_fc_norm_embedding(self.embed(input_ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden.to(e.dtype))], dim=-1))
        x = self.layers[step % len(self.layers)](positions, x, ctx)
        return self.norm(x)


def load_mtp(model_dir: str | Path, cfg, target: nn.Module, dtype: torch.dtype,
             max_positions: int, device: torch.device) -> MultiTokenPredictor:
    """Build the MTP block and fill it from the checkpoint's ``mtp.*`` tensors (raises a
    ``ValueError`` naming what is missing when the checkpoint lacks them)."""
    if not num_mtp_layers(cfg):
        raise ValueError("the config declares no MTP layers (mtp_num_hidden_layers)")
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            mtp = MultiTokenPredictor(cfg, max_positions)
    finally:
        torch.set_default_dtype(prev)
    prefixes = ("mtp.", "model.mtp.", "model.language_model.mtp.")

    def stream():
        for name, t in iter_weights(Path(model_dir)):
            for p in prefixes:
                if name.startswith(p):
                    yield name[len(p):], t
                    break

    experts = ExpertWeightRouter(mtp)
    loaded = load_into(mtp, experts.route(stream()), rename=HybridCausalLM.fused_names)
    got = {n.split(":")[0] for n in loaded} | experts.complete()
    missing = [n for n, _ in mtp.named_parameters() if n not in got]
    if missing:
        raise ValueError(
            f"speculative method 'mtp' needs the checkpoint's multi-token-prediction weights "
            f"(mtp.* tensors); {model_dir} lacks {len(missing)} of them, e.g. "
            f"mtp.{missing[0]}. Use {{\"method\": \"ngram\", ...}} or a draft 'model' instead.")
    mtp.eval().requires_grad_(False)
    mtp.embed = target_embedding(target).__call__
    return mtp


class MtpProposer(HiddenStateProposer):
    """Drafts with the MTP block (see the module docstring): the target's ``lm_head`` gives
    the logits of the block's normed output."""

    def __init__(self, mtp: MultiTokenPredictor, target: nn.Module) -> None:
        super().__init__(mtp, target.compute_logits)
        self.mtp = mtp
        self.target = target
