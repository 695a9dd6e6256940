"""Qwen3-Next: Qwen3.5's hybrid stack (GDN + gated attention) with sparse MoE feed-forwards.

Everything but the feed-forward block and the GDN input projections is shared with
:mod:`pagefold.models.qwen3_5`. The two differences:

* MLPs: layer ``i`` is a :class:`~pagefold.layers.moe.SparseMoeBlock` (softmax router, top-k,
  optional renormalisation, sigmoid-gated shared expert) when ``num_experts > 0``, ``i`` is not
  in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``; else a dense SwiGLU MLP.
* GDN projections: the checkpoint has ``in_proj_qkvz`` and ``in_proj_ba``, grouped per key
  head: for each of the Hk key heads, rows ``[q (Dk) | k (Dk) | v (r*Dv) | z (r*Dv)]`` and
  ``[b (r) | a (r)]`` with ``r = Hv / Hk``. :func:`split_qkvz` / :func:`split_ba` regroup
  those rows at load time into Qwen3.5's ``in_proj_qkv`` (all q, all k, all v), ``in_proj_z``,
  ``in_proj_b`` and ``in_proj_a``, so the forward pass is exactly Qwen3.5's. Value head
  ``h = key_head * r + j`` in both layouts, as transformers' reshapes give.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from pagefold.layers.moe import SparseMoeBlock
from pagefold.models.qwen3_5 import HybridCausalLM, HybridModel, dense_mlp
from pagefold.quantization.formats import QuantizationError

__all__ = ["Qwen3NextForCausalLM", "split_ba", "split_qkvz"]


def split_qkvz(w: torch.Tensor, nk: int, dk: int, nv: int, dv: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``in_proj_qkvz`` rows (Hk * (2Dk + 2rDv), ...) -> (qkv rows (2HkDk + HvDv, ...),
    z rows (HvDv, ...)) in Qwen3.5's order. Works for weights and biases alike."""
    r = nv // nk
    rest = tuple(w.shape[1:])
    per = w.reshape(nk, 2 * dk + 2 * r * dv, *rest)
    q, k, v, z = per.split([dk, dk, r * dv, r * dv], dim=1)
    qkv = torch.cat([q.reshape(nk * dk, *rest), k.reshape(nk * dk, *rest),
                     v.reshape(nv * dv, *rest)], dim=0)
    return qkv, z.reshape(nv * dv, *rest)


def split_ba(w: torch.Tensor, nk: int, nv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``in_proj_ba`` rows (Hk * 2r, ...) -> (b rows (Hv, ...), a rows (Hv, ...))."""
    r = nv // nk
    rest = tuple(w.shape[1:])
    b, a = w.reshape(nk, 2 * r, *rest).split([r, r], dim=1)
    return b.reshape(nv, *rest), a.reshape(nv, *rest)


def is_sparse_layer(cfg, layer_idx: int) -> bool:
    """transformers' rule for which Qwen3-Next layers get an MoE block."""
    mlp_only = getattr(cfg, "mlp_only_layers", None) or []
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return (layer_idx not in mlp_only and getattr(cfg, "num_experts", 0) > 0
            and (layer_idx + 1) % step == 0)


def next_mlp(cfg, layer_idx: int) -> nn.Module:
    if not is_sparse_layer(cfg, layer_idx):
        return dense_mlp(cfg, layer_idx)
    return SparseMoeBlock(
        cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
        norm_topk_prob=bool(getattr(cfg, "norm_topk_prob", True)),
        shared_inter=getattr(cfg, "shared_expert_intermediate_size", 0) or 0,
        act=getattr(cfg, "hidden_act", "silu"),
    )


class Qwen3NextForCausalLM(HybridCausalLM):
    """Qwen3-Next (GDN + gated attention + MoE). Loads per-expert or stacked expert weights."""

    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__(cfg, HybridModel(cfg, max_positions, next_mlp))
        self._dims = (cfg.linear_num_key_heads, cfg.linear_key_head_dim,
                      cfg.linear_num_value_heads, cfg.linear_value_head_dim)

    def convert_weight(self, name: str, tensor: torch.Tensor
                       ) -> Iterator[tuple[str, torch.Tensor]]:
        nk, dk, nv, dv = self._dims
        if (".linear_attn.in_proj_qkvz." in name or ".linear_attn.in_proj_ba." in name) and (
                not name.endswith(".weight") or tensor.dtype == torch.float8_e4m3fn):
            # Their rows are reshuffled here; a quantized layout (packed rows, group scales)
            # would need the same reshuffle per tensor.
            raise QuantizationError(f"{name}: Qwen3-Next's Gated DeltaNet input projections "
                                    "stored quantized are not supported (keep them plain)")
        if ".linear_attn.in_proj_qkvz." in name:
            qkv, z = split_qkvz(tensor, nk, dk, nv, dv)
            yield name.replace("in_proj_qkvz", "in_proj_qkv"), qkv
            yield name.replace("in_proj_qkvz", "in_proj_z"), z
        elif ".linear_attn.in_proj_ba." in name:
            b, a = split_ba(tensor, nk, nv)
            yield name.replace("in_proj_ba", "in_proj_b"), b
            yield name.replace("in_proj_ba", "in_proj_a"), a
        else:
            yield name, tensor
