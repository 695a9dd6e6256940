"""Sparse mixture-of-experts block: softmax router, top-k, optional shared expert.

Equations (transformers' ``Qwen3NextSparseMoeBlock`` / ``Qwen3MoeSparseMoeBlock``), for one flat
batch ``x`` of shape (T, hidden):

    p      = softmax(x @ W_router^T) in float32                   (T, E)
    w, idx = topk(p, k)                                           (T, k)
    w      = w / sum(w) if norm_topk_prob, then cast to x's dtype
    y      = sum_j w_j * expert_{idx_j}(x)                        experts summed in index order
    y     += sigmoid(x @ w_shared_gate^T) * shared_expert(x)      (when the block has one)

with ``expert_e(x) = down_e(silu(gate_e(x)) * up_e(x))``. Only experts that receive at least one
token run, each over exactly its tokens (``index_select`` in, ``index_add_`` out), so the cost
is ``T * k`` expert rows rather than ``T * E``. Contributions are added in ascending expert
order into zeros, as transformers does, so float results match it bit for bit.

Expert weights are stacked like transformers' in-memory layout: ``experts.gate_up_proj``
(E, 2 * inter, hidden) with the gate rows first, ``experts.down_proj`` (E, hidden, inter).
Checkpoints store them either that way (loaded by name) or per expert
(``experts.{e}.gate_proj.weight`` ...), which :class:`ExpertWeightRouter` copies in place.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagefold.csrc.gemm import matmul_t
from pagefold.layers.mlp import GatedMLP

__all__ = ["ExpertWeightRouter", "MoEExperts", "SparseMoeBlock"]


class MoEExperts(nn.Module):
    """``E`` SwiGLU experts with stacked weights; runs only the experts that receive tokens."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.inter = inter
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def forward(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """x (T, hidden), top_idx (T, k) int64, top_w (T, k) in x's dtype -> (T, hidden)."""
        t, k = top_idx.shape
        out = torch.zeros_like(x)
        if t == 0:
            return out
        flat = top_idx.reshape(-1)
        # Stable sort keeps each expert's tokens in ascending token order.
        order = torch.argsort(flat, stable=True)
        tokens = order // k
        weights = top_w.reshape(-1)[order]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host sync
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start : start + n]
            h = x.index_select(0, rows)
            gate, up = matmul_t(h, self.gate_up_proj[e]).split(self.inter, dim=-1)
            y = matmul_t(F.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, rows, y * weights[start : start + n, None])
            start += n
        return out

    def load_expert(self, e: int, proj: str, tensor: torch.Tensor) -> None:
        """Copy one per-expert checkpoint matrix (``gate_proj``/``up_proj``/``down_proj``)."""
        if not 0 <= e < self.num_experts:
            raise ValueError(f"expert index {e} out of range for {self.num_experts} experts")
        if proj == "down_proj":
            dst = self.down_proj.data[e]
        else:
            lo = 0 if proj == "gate_proj" else self.inter
            dst = self.gate_up_proj.data[e, lo : lo + self.inter]
        if dst.shape != tensor.shape:
            raise ValueError(f"expert {e} {proj}: checkpoint shape {tuple(tensor.shape)} != "
                             f"model shape {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(tensor)


class SparseMoeBlock(nn.Module):
    """Router + routed experts + optional sigmoid-gated shared expert.

    Parameter names follow transformers (``gate``, ``experts``, ``shared_expert``,
    ``shared_expert_gate``) so checkpoints load by name; the shared expert's gate/up projections
    are fused into ``shared_expert.gate_up_proj`` like every pagefold MLP.
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, moe_inter: int, *,
                 norm_topk_prob: bool, shared_inter: int = 0, shared_gate: bool = True,
                 act: str = "silu") -> None:
        super().__init__()
        if act != "silu":
            raise ValueError(f"unsupported MoE expert activation {act!r} (only silu)")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in [1, num_experts={num_experts}]")
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = MoEExperts(num_experts, hidden, moe_inter)
        self.shared_expert = GatedMLP(hidden, shared_inter, act=act) if shared_inter else None
        self.shared_expert_gate = (nn.Linear(hidden, 1, bias=False)
                                   if shared_inter and shared_gate else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> (top-k weights (T, k) in x's dtype, expert ids (T, k))."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_w, top_idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_w.to(logits.dtype), top_idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_w, top_idx = self.route(x)
        out = self.experts(x, top_idx, top_w)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


_PER_EXPERT = re.compile(r"^(?P<mod>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                         r"\.weight$")


class ExpertWeightRouter:
    """Takes per-expert checkpoint tensors out of a weight stream and copies them in place.

    ``route(weights)`` yields every other tensor unchanged (for ``load_into``). Afterwards
    ``complete()`` names the stacked parameters every piece of which was loaded this way.
    """

    def __init__(self, model: nn.Module) -> None:
        self.modules = {n: m for n, m in model.named_modules() if isinstance(m, MoEExperts)}
        self.seen: dict[str, set[tuple[int, str]]] = {}

    def route(self, weights: Iterable[tuple[str, torch.Tensor]]
              ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            m = _PER_EXPERT.match(name)
            if m is None or m["mod"] not in self.modules:
                yield name, tensor
                continue
            self.modules[m["mod"]].load_expert(int(m["e"]), m["proj"], tensor)
            self.seen.setdefault(m["mod"], set()).add((int(m["e"]), m["proj"]))

    def complete(self) -> set[str]:
        done = set()
        for mod, seen in self.seen.items():
            n = self.modules[mod].num_experts
            if all((e, p) in seen for e in range(n) for p in ("gate_proj", "up_proj")):
                done.add(f"{mod}.gate_up_proj")
            if all((e, "down_proj") in seen for e in range(n)):
                done.add(f"{mod}.down_proj")
        return done
