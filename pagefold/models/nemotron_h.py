"""Nemotron-H (NemotronHForCausalLM): one mixer per block -- Mamba-2, attention, MLP or MoE.

Each block is ``x + mixer(norm(x))``. The block kinds come from ``layers_block_type`` (or the
older ``hybrid_override_pattern`` string: ``M`` Mamba-2, ``*`` attention, ``-`` MLP, ``E`` MoE).
Attention has no positional encoding (the Mamba layers carry position); MLPs are ungated
``down(relu(up(x)) ** 2)``. Checkpoint weights live under ``backbone.`` (the original layout;
transformers-saved copies use ``model.``, which is mapped back). Inputs are a flat token batch:
``forward(input_ids (T,), positions (T,), ctx) -> hidden (T, hidden)``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagefold.core.layer_kinds import FULL, MAMBA2, MLP, MOE, layer_kinds
from pagefold.distributed.parallel_state import all_reduce
from pagefold.executor.forward_context import ForwardContext
from pagefold.layers.activations import get_activation
from pagefold.layers.attention_block import GQAAttention
from pagefold.layers.decoder_stack import DecoderStack
from pagefold.layers.lm_head import CausalLMHead
from pagefold.layers.mlp import UngatedMLP
from pagefold.layers.norm import RMSNorm
from pagefold.layers.vocab import vocab_embedding
from pagefold.models.mamba2_hybrid import Mamba2Config, Mamba2Mixer
from pagefold.models.weights import load_into
from pagefold.ops import elementwise

__all__ = ["NemotronHForCausalLM", "nemotron_h_block_kinds"]

_KIND_NAMES = {MAMBA2: "mamba", FULL: "attention", MLP: "mlp", MOE: "moe"}


def nemotron_h_block_kinds(cfg) -> list[str]:
    """Per-block kind (``mamba``, ``attention``, ``mlp``, ``moe``) from a Nemotron-H config,
    read by the same parser that sizes the cache (``core/layer_kinds.py``)."""
    return [_KIND_NAMES[k] for k in layer_kinds(cfg, "nemotron_h")]


class NemotronHRMSNorm(RMSNorm):
    """RMSNorm whose weight multiply stays in float32 before the cast back (transformers'
    NemotronHRMSNorm; differs from the Llama norm only below float32).

    On the CPU the compiled norm's mode 2 (``elementwise.NORM_FLOAT_WEIGHT``) computes it in one
    pass with the same roundings (the sum of squares in another order); elsewhere, or with
    the kernels off, :meth:`reference`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            out = elementwise.rms_norm(x, self.weight, self.eps,
                                      elementwise.NORM_FLOAT_WEIGHT)
            if out is not None:
                return out
        return self.reference(x)

    def native_norm(self) -> tuple[int, float, int] | None:
        """The native decode step's norm: the kernel's float32-weight mode, as forward."""
        base = super().native_norm()
        return None if base is None else (base[0], base[1], elementwise.NORM_FLOAT_WEIGHT)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


def _act(name: str):
    return get_activation(name, ("relu2", "silu", "swish", "relu"), "Nemotron-H MLP activation")


NemotronHMLP = UngatedMLP


class NemotronHAttention(GQAAttention):
    """GQA attention without RoPE; q/k/v fused into ``qkv_proj`` at load time."""

    def __init__(self, cfg, layer_idx: int) -> None:
        bias = bool(getattr(cfg, "attention_bias", False))
        super().__init__(cfg, layer_idx, qkv_bias=bias, o_bias=bias, qk_norm=False,
                         max_positions=0, rotary_dim=None)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return super().forward(None, x, ctx)


class NemotronHRouter(nn.Module):
    """Sigmoid top-k router with score-correction bias and group-limited selection (float32)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.num_experts = cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.n_group = getattr(cfg, "n_group", 1) or 1
        self.topk_group = getattr(cfg, "topk_group", 1) or 1
        self.norm_topk_prob = bool(getattr(cfg, "norm_topk_prob", True))
        self.scaling = float(getattr(cfg, "routed_scaling_factor", 1.0))
        # transformers keeps the router in float32 whatever the model dtype.
        self.weight = nn.Parameter(torch.zeros(self.num_experts, cfg.hidden_size,
                                               dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts,
                                                                dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> (weights (T, top_k) float32, expert ids (T, top_k))."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        per_group = self.num_experts // self.n_group
        if self.n_group > 1:
            group_scores = choice.view(-1, self.n_group, per_group).topk(2, dim=-1)[0].sum(-1)
            group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_idx, True)
            keep = keep.unsqueeze(-1).expand(-1, self.n_group, per_group).reshape(choice.shape)
            choice = choice.masked_fill(~keep, float("-inf"))
        idx = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.scaling, idx


class NemotronHMoE(nn.Module):
    """Routed relu^2 experts (optionally in a latent space) plus an always-on shared expert.

    Tensor parallelism: every expert (and the shared one) keeps this rank's ``1/N`` of its
    intermediate dimension and returns a partial sum; router and latent projections are
    replicated; the partials are summed with one all-reduce (two with a latent space, whose
    up-projection must see the full sum)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        bias, act = bool(getattr(cfg, "mlp_bias", False)), cfg.mlp_hidden_act
        latent = getattr(cfg, "moe_latent_size", None)
        dim = latent or cfg.hidden_size
        self.gate = NemotronHRouter(cfg)
        self.experts = nn.ModuleList(
            NemotronHMLP(dim, cfg.moe_intermediate_size, False, act, reduce=False,
                         what="moe_intermediate_size") for _ in range(cfg.n_routed_experts))
        self.shared_experts = NemotronHMLP(
            cfg.hidden_size, cfg.moe_shared_expert_intermediate_size, bias, act, reduce=False,
            what="moe_shared_expert_intermediate_size")
        if latent is not None:
            self.fc1_latent_proj = nn.Linear(cfg.hidden_size, latent, bias=bias)
            self.fc2_latent_proj = nn.Linear(latent, cfg.hidden_size, bias=bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, idx = self.gate(x)
        h = self.fc1_latent_proj(x) if self.fc1_latent_proj is not None else x
        out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start : start + n]
            start += n
            tok, slot = sel // idx.shape[1], sel % idx.shape[1]
            y = self.experts[e](h[tok]) * weights[tok, slot, None]
            out.index_add_(0, tok, y.float())
        if self.fc2_latent_proj is None:
            return all_reduce(out.to(h.dtype) + self.shared_experts(x))
        out = self.fc2_latent_proj(all_reduce(out).to(h.dtype))
        return out + all_reduce(self.shared_experts(x))


class NemotronHBlock(nn.Module):
    def __init__(self, cfg, layer_idx: int, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.norm = NemotronHRMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        if kind == "mamba":
            self.mixer = Mamba2Mixer(Mamba2Config.from_nemotron_h(cfg), f"layers.{layer_idx}")
        elif kind == "attention":
            self.mixer = NemotronHAttention(cfg, layer_idx)
        elif kind == "mlp":
            self.mixer = NemotronHMLP(cfg.hidden_size, cfg.intermediate_size,
                                      bool(getattr(cfg, "mlp_bias", False)), cfg.mlp_hidden_act)
        else:
            self.mixer = NemotronHMoE(cfg)

    def native_blocks(self) -> list[tuple[nn.Module, nn.Module]]:
        """The native decode step's block: (norm, mixer)."""
        return [(self.norm, self.mixer)]

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.norm(x)
        if self.kind in ("mamba", "attention"):
            return x + self.mixer(h, ctx)
        return x + self.mixer(h)


class NemotronHModel(DecoderStack):
    """Embeddings -> blocks -> ``norm_f`` (``DecoderStack``). No RoPE: the positions are never
    read (the native step takes the token ids in their place)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        kinds = nemotron_h_block_kinds(cfg)
        self.build_stack(
            len(kinds), lambda i: NemotronHBlock(cfg, i, kinds[i]),
            lambda: vocab_embedding(cfg.vocab_size, cfg.hidden_size),
            lambda: NemotronHRMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon),
            hidden_size=cfg.hidden_size, tied=bool(getattr(cfg, "tie_word_embeddings", False)),
            embed_name="embeddings", norm_name="norm_f")

    def run_layer(self, layer, positions, x, residual, ctx):
        return layer(x, ctx), None

    def native_final(self, out, residual):
        return self.norm_f(out + residual)  # the module path's last add, then the norm


class NemotronHForCausalLM(CausalLMHead):
    """``forward(input_ids (T,), positions (T,), ctx) -> (T, hidden)``; positions are unused
    (no RoPE). ``compute_logits(hidden) -> (T, vocab)`` float32."""

    fused_names = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}

    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__()
        del max_positions  # no positional encoding
        self.config = cfg
        self.backbone = NemotronHModel(cfg)
        self.init_head(cfg, self.backbone.embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        return self.backbone(input_ids, input_ids, ctx)  # ids stand in for positions

    def _renamed(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """Checkpoint names -> ours: ``model.`` -> ``backbone.``, stacked expert tensors (as
        transformers saves them) -> one tensor per expert, multi-token-prediction heads dropped.
        """
        for name, tensor in weights:
            if name.startswith("mtp.") or ".mtp." in name:
                continue
            if name.startswith("model."):
                name = "backbone." + name[len("model."):]
            if name.endswith(("mixer.experts.up_proj", "mixer.experts.down_proj")):
                base, proj = name.rsplit(".", 1)
                for e, t in enumerate(tensor.unbind(0)):
                    yield f"{base}.{e}.{proj}.weight", t
                continue
            yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.check_loaded(load_into(self, self._renamed(weights), rename=self.fused_names,
                                    skip_prefixes=self.head_skip_prefixes))
