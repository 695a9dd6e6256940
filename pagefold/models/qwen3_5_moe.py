"""Qwen3.5 / Qwen3.6 MoE (``Qwen3_5MoeForCausalLM``, e.g. Qwen3.6-35B-A3B): Qwen3.5's hybrid
stack (Gated DeltaNet + gated full attention, :mod:`pagefold.models.qwen3_5`) with a sparse MoE
feed-forward in every layer.

transformers' ``Qwen3_5MoeSparseMoeBlock``, per flat batch ``x`` (T, hidden):

    p      = softmax(x @ gate.weight^T) in float32;  w, idx = topk(p, num_experts_per_tok)
    w      = (w / sum(w)).to(x.dtype)                           (always renormalised)
    y      = sum_j w_j * expert_{idx_j}(x)  +  sigmoid(x @ shared_expert_gate^T) * shared(x)

with SwiGLU experts (``moe_intermediate_size``) and a SwiGLU shared expert
(``shared_expert_intermediate_size``): exactly :class:`~pagefold.layers.moe.SparseMoeBlock`
with ``norm_topk_prob=True``. Unlike Qwen3-Next there is no ``decoder_sparse_step`` /
``mlp_only_layers`` and the GDN projections are stored as Qwen3.5's (``in_proj_qkv``,
``in_proj_z``, ``in_proj_b``, ``in_proj_a``), so nothing is regrouped at load time.

Checkpoints: experts stacked as transformers keeps them (``mlp.experts.gate_up_proj``
(E, 2I, H), ``mlp.experts.down_proj`` (E, H, I)) or per expert
(``mlp.experts.{e}.gate_proj.weight`` ...); text weights under ``model.*`` or, for the
multimodal ``Qwen3_5MoeForConditionalGeneration``, under ``model.language_model.*`` with the
vision tower and the MTP head skipped (:class:`~pagefold.models.qwen3_5.HybridCausalLM`).
"""

from __future__ import annotations

from torch import nn

from pagefold.layers.moe import SparseMoeBlock
from pagefold.models.qwen3_5 import HybridCausalLM, HybridModel

__all__ = ["Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration", "moe_mlp"]


def moe_mlp(cfg, layer_idx: int) -> nn.Module:
    """Layer ``layer_idx``'s feed-forward: always the sparse MoE block."""
    return SparseMoeBlock(
        cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
        norm_topk_prob=True, shared_inter=cfg.shared_expert_intermediate_size,
        act=getattr(cfg, "hidden_act", "silu"),
    )


class Qwen3_5MoeForCausalLM(HybridCausalLM):
    """Qwen3.5-MoE text model (GDN + gated attention, MoE with a gated shared expert)."""

    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__(cfg, HybridModel(cfg, max_positions, moe_mlp))


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    """The published multimodal checkpoints: the same text model, weights under
    ``model.language_model.*``; built from the (registry-unwrapped) ``text_config``, the
    vision tower is not loaded, so only text prompts are served."""
