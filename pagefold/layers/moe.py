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

Tensor parallelism (vLLM's TP-for-MoE): every rank holds every expert, with its ``1/N`` of
the intermediate dimension -- rows ``[gate_r | up_r]`` of ``gate_up_proj`` and the matching
columns of ``down_proj`` -- so ``down_e`` gives a partial sum. The router is replicated (every
rank routes the same tokens to the same experts), the shared expert is split the same way,
and the block sums the partials of the routed and shared experts with one all-reduce.

Expert parallelism (``enable_expert_parallel``): each rank holds ``E / N`` whole experts
instead; ``layers/expert_parallel.py`` dispatches locally and combines exactly (the routed sum
is one rank's bits), the shared expert staying tensor-parallel in the same collective.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagefold.csrc import cpu_ops
from pagefold.csrc.gemm import matmul_t
from pagefold.distributed.parallel_state import all_reduce, tp_rank, tp_size
from pagefold.layers.expert_parallel import expert_shard, routed_ep, shard_experts
from pagefold.layers.linear import shard_rows
from pagefold.layers.lora_experts import ExpertsLayout
from pagefold.layers.mlp import GatedMLP
from pagefold.layers.moe_rows import grouped_forward
from pagefold.layers.native_record import Step, gemv_of, gemv_ready
from pagefold.ops import elementwise

__all__ = ["ExpertWeightRouter", "MoEExperts", "SparseMoeBlock"]


def split_expert_inter(inter: int, what: str = "moe_intermediate_size") -> int:
    """This rank's share of an expert's intermediate size; a ValueError naming ``what`` when
    it does not divide."""
    if inter % tp_size():
        raise ValueError(f"{what} ({inter}) is not divisible by tensor_parallel_size "
                         f"{tp_size()} (MoE experts split their intermediate dimension)")
    return inter // tp_size()


def _no_gemv(*args: object) -> int:
    return 1  # the GEMV's "not handled" code: every product falls back to matmul_t


_BF16 = cpu_ops.DTYPE_CODE[torch.bfloat16]  # the kernels' dtype code
# ``PAGEFOLD_NATIVE_DECODE=0`` keeps the few-token experts in Python too (tests flip this).
NATIVE = os.environ.get("PAGEFOLD_NATIVE_DECODE", "1") != "0"


class MoEExperts(nn.Module):
    """``E`` SwiGLU experts with stacked weights; runs only the experts that receive tokens.

    Under tensor parallelism ``inter`` is this rank's share and the output a partial sum (the
    owning block all-reduces).

    Steps of at most as many bf16 tokens as both expert products' GEMVs take (decode) take
    :meth:`_few_rows`: the GEMVs ``use_fast_linears`` chose for one expert's gate_up and down
    shapes (:meth:`gemv_shapes` / :meth:`set_gemv_choices`), ``cpu_ops.default_choice()``'s
    on a module never routed. With ``use_gemv`` (the default) their expert products are the
    GEMVs', whose float32 sums
    can round the last bit of a rare output differently from oneDNN's ``F.linear`` (the same
    contract as every ``nn.Linear`` of such steps under ``cpu_ops.use_fast_linears``); without
    it they are ``F.linear``'s and the block's output is :meth:`forward`'s general path's bit
    for bit. float32 never takes the GEMV. Larger bf16 CPU steps without LoRA take
    ``moe_rows.grouped_forward`` (short runs through the GEMVs in one C call, long runs
    through oneDNN, one C call for the weighted sum: the general path's bits where the GEMVs
    are off); float32, LoRA and quantized experts take the general path, a loop over the
    experts that drew tokens."""

    use_gemv: bool = True
    # Quantized experts (``quantization.experts``): per expert a module whose ``gate_up_proj``
    # and ``down_proj`` are its products; the stacked parameters are then gone (None).
    quantized: list | None = None
    pf_gemv: tuple | None = None  # (gate_up's, down's) gemv_choice.Choice, set when routed
    # Resident LoRA adapters (``layers/lora_experts.LoRAExperts``), attached by the LoRA
    # manager: ``rows(tokens)`` gives the routed rows' slots (None: no adapter row this step)
    # and ``add(e, proj, x, y, slots)`` adds expert ``e``'s term to a product's rows.
    lora = None
    # Input rows per step token (Llama 4 feeds each token's k pre-scaled copies, token-major):
    # row ``i`` is token ``i // rows_per_token``, whose adapter slot its LoRA terms use.
    rows_per_token: int = 1

    def __init__(self, num_experts: int, hidden: int, inter: int,
                 what: str = "moe_intermediate_size") -> None:
        super().__init__()
        # Expert parallelism: this rank's whole experts (``num_experts`` then counts them;
        # ``total_experts`` and the router's ids are global).
        self.ep = expert_shard(num_experts)
        self.total_experts = num_experts
        self.first_expert = self.ep.first if self.ep is not None else 0
        self.num_experts = num_experts = self.ep.count if self.ep is not None else num_experts
        self.full_inter = inter
        if self.ep is None:
            inter = split_expert_inter(inter, what)
        self.inter = inter
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))
        if self.ep is not None:  # stacked checkpoint tensors: this rank's experts, whole
            shard_experts(self.gate_up_proj, self.ep)
            shard_experts(self.down_proj, self.ep)
            return
        # Stacked checkpoint tensors (E, 2I, H) / (E, H, I): this rank's gate and up rows,
        # its down columns.
        shard_rows(self.gate_up_proj, [self.full_inter] * 2, what, dim=1)
        shard_rows(self.down_proj, [self.full_inter], what, dim=2)

    # Where quantized experts live below this module ("": ``<this>.<e>``), for the loaders.
    experts_path = ""

    def expert_dims(self) -> tuple[int, int, int]:
        """(local experts, hidden, this rank's intermediate size) of the stacked experts."""
        return self.num_experts, self.gate_up_proj.shape[2], self.inter

    def expert_stacks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stacked (gate_up, down) parameters quantized experts replace."""
        return self.gate_up_proj, self.down_proj

    def install_quantized(self, experts: list[nn.Module], first: int = 0) -> None:
        """Quantized experts (``quantization.experts``) replace the stacked parameters:
        local expert ``e`` is ``experts[e]``, the child ``str(first + e)`` (its checkpoint
        name), whose ``gate_up_proj`` / ``down_proj`` run it."""
        del self.gate_up_proj, self.down_proj
        self.gate_up_proj = self.down_proj = None  # the stacked weights are gone
        for e, ex in enumerate(experts):
            self.add_module(str(first + e), ex)
        self.quantized = experts

    def lora_stack(self) -> tuple[str, ExpertsLayout, torch.Tensor] | None:
        """For LoRA on the stacked experts: (the adapters' module path relative to this one,
        the layout, a weight for dtype and device); None for quantized experts (no stacks)."""
        if self.quantized is not None:
            return None
        return "", ExpertsLayout(self.total_experts, self.first_expert, self.num_experts,
                                 self.down_proj.shape[1], self.full_inter,
                                 self.inter), self.down_proj

    def gemv_shapes(self) -> list[tuple[int, int]]:
        """One expert's gate_up and down (N, K), for ``cpu_ops.use_fast_linears`` to choose
        their GEMVs ([] unless the stacked weights are bf16 on the CPU)."""
        gu, dn = self.gate_up_proj, self.down_proj
        if self.quantized is not None or not all(
                w.dtype == torch.bfloat16 and w.device.type == "cpu" for w in (gu, dn)):
            return []
        return [(gu.shape[1], gu.shape[2]), (dn.shape[1], dn.shape[2])]

    def set_gemv_choices(self, choices: list) -> None:
        """The GEMVs of :meth:`gemv_shapes`' products, in its order."""
        self.pf_gemv = tuple(choices) if len(choices) == 2 else None

    def gemv_pair(self) -> tuple:
        """(gate_up's, down's) GEMV choice: routed, else the process default."""
        if self.pf_gemv is not None:
            return self.pf_gemv
        c = cpu_ops.default_choice()
        return c, c

    def forward(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """x (T, hidden), top_idx (T, k) int64, top_w (T, k) in x's dtype -> (T, hidden)."""
        if self.ep is not None:
            return self.forward_ep(x, top_idx, top_w)[0]
        t, k = top_idx.shape
        if t == 0:
            return torch.zeros_like(x)
        lora = self.lora is not None and self.lora.step.idx is not None
        out = None
        if self.quantized is None and not lora:
            out = self._few_rows(x, top_idx, top_w)
            if out is None and self._grouped_ok(x, top_idx, top_w):
                out = grouped_forward(x, top_idx, top_w, self.gate_up_proj, self.down_proj,
                                      self.gemv_pair() if self.use_gemv else None)
        if out is not None:
            return out
        out = torch.zeros_like(x)
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
            y = self._expert(e, x.index_select(0, rows), rows)
            out.index_add_(0, rows, y * weights[start : start + n, None])
            start += n
        return out

    def _grouped_ok(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> bool:
        """Whether :func:`~pagefold.layers.moe_rows.grouped_forward` takes this step: bf16 CPU
        rows and stacked weights, int64 ids (``PAGEFOLD_NATIVE_DECODE=0`` keeps the loop)."""
        gu_w, dn_w = self.gate_up_proj, self.down_proj
        return (NATIVE and x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_cpu
                and x.stride(1) == 1 and top_idx.dtype == torch.int64
                and top_w.dtype == torch.bfloat16 and gu_w.dtype == torch.bfloat16
                and dn_w.dtype == torch.bfloat16 and gu_w.is_cpu
                and gu_w.is_contiguous() and dn_w.is_contiguous())

    def _expert(self, e: int, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Local expert ``e`` on rows ``h`` (those of ``tokens``):
        ``down(silu(gate(h)) * up(h))``, each product with its rows' LoRA terms if any."""
        q = self.quantized[e] if self.quantized is not None else None
        slots = None
        if self.lora is not None:
            n = self.rows_per_token
            slots = self.lora.rows(tokens if n == 1 else tokens // n)
        gu = matmul_t(h, self.gate_up_proj[e]) if q is None else q.gate_up_proj(h)
        if slots is not None:
            self.lora.add(e, "gate_up_proj", h, gu, slots)
        act = elementwise.silu_and_mul(gu)  # one kernel; the torch ops where it declines
        if act is None:
            gate, up = gu.split(self.inter, dim=-1)
            act = F.silu(gate) * up
        y = matmul_t(act, self.down_proj[e]) if q is None else q.down_proj(act)
        if slots is not None:
            self.lora.add(e, "down_proj", act, y, slots)
        return y

    def forward_ep(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor,
                   extra: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Expert parallelism: the routed sum over every rank's experts (complete, the same
        on every rank; ``layers/expert_parallel.py``) and ``extra`` (a partial sum) reduced in
        the same collective."""
        return routed_ep(x, top_idx, self.ep,
                         lambda e, tok, slot: self._expert(e, x.index_select(0, tok), tok)
                         * top_w[tok, slot, None], extra)

    def _few_rows(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor
                  ) -> torch.Tensor | None:
        """:meth:`forward` for bf16 steps of at most as many tokens as both GEMVs take (decode):
        the same experts, token order, products and summation order, but each expert's two
        products call their GEMVs on its weight slices' pointers (as ``nn.Linear`` layers do for
        such steps under ``use_fast_linears``) and the grouping is done on the host from one
        ``tolist`` instead of argsort / bincount / per-expert gathers. None when not handled."""
        gu_c, dn_c = self.gemv_pair()
        gemv, gemv_dn = (gu_c.fn, dn_c.fn) if self.use_gemv else (_no_gemv, _no_gemv)
        gu_w, dn_w = self.gate_up_proj, self.down_proj
        t, k = top_idx.shape
        if (gemv is None or gemv_dn is None or x.dtype != torch.bfloat16
                or gu_w.dtype != torch.bfloat16 or dn_w.dtype != torch.bfloat16
                or top_w.dtype != torch.bfloat16
                or x.dim() != 2 or not x.is_cpu or not gu_w.is_cpu
                or t > min(gu_c.max_rows, dn_c.max_rows)
                or x.stride(1) != 1 or not gu_w.is_contiguous() or not dn_w.is_contiguous()):
            return None
        if self.use_gemv and NATIVE and top_idx.dtype == torch.int64:
            out = self._few_rows_native(x, top_idx, top_w)
            if out is not None:
                return out
        flat = top_idx.reshape(-1).tolist()  # one host sync, as bincount's in forward
        # Positions p = token * k + slot grouped by ascending expert, tokens ascending within
        # one (top-k ids of a token are distinct): forward's stable argsort order.
        order = sorted(range(t * k), key=lambda p: (flat[p], p))
        hidden, inter = x.shape[1], self.inter
        gu_step = gu_w.stride(0) * gu_w.element_size()
        dn_step = dn_w.stride(0) * dn_w.element_size()
        threads = torch.get_num_threads()
        lib = cpu_ops.kernels()
        silu = lib.pf_silu_mul if lib is not None else None
        w_col = top_w.reshape(-1, 1)
        out = torch.zeros_like(x)
        i = 0
        while i < len(order):
            e = flat[order[i]]
            j = i + 1
            while j < len(order) and flat[order[j]] == e:
                j += 1
            ps, n, i = order[i:j], j - i, j
            if n == t:  # every token, in order: no gather, a plain add (index_add_'s bits)
                h, rows = x, None
            else:
                rows = torch.tensor([p // k for p in ps])
                h = x.index_select(0, rows)
            gu = torch.empty((n, 2 * inter), dtype=torch.bfloat16)
            if gemv(h.data_ptr(), h.stride(0), gu_w.data_ptr() + e * gu_step, None,
                    gu.data_ptr(), 2 * inter, n, 2 * inter, hidden, threads) != 0:
                gu = matmul_t(h, gu_w[e])
            # silu(gate) * up rounded like the torch ops (elementwise.cpu.silu_and_mul without its
            # per-call checks: gu is a fresh contiguous bf16 (n, 2I) tensor).
            act = torch.empty((n, inter), dtype=torch.bfloat16)
            if silu is None or silu(_BF16, gu.data_ptr(), gu.stride(0), act.data_ptr(), n, inter,
                                    threads) != 0:
                gate, up = gu.split(inter, dim=-1)
                act = F.silu(gate) * up
            y = torch.empty((n, hidden), dtype=torch.bfloat16)
            if gemv_dn(act.data_ptr(), act.stride(0), dn_w.data_ptr() + e * dn_step, None,
                    y.data_ptr(), hidden, n, hidden, inter, threads) != 0:
                y = matmul_t(act, dn_w[e])
            w = w_col[ps[0] : ps[0] + 1] if n == 1 else w_col.index_select(0, torch.tensor(ps))
            if rows is None:
                out.add_(y * w)
            else:
                out.index_add_(0, rows, y * w)
        return out

    def _few_rows_native(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor
                         ) -> torch.Tensor | None:
        """:meth:`_few_rows` (its checks passed) in one C call (``csrc/moe.cpp``): the same
        grouping, GEMV, SiLU kernel and roundings, without a dozen torch ops per expert."""
        lib = cpu_ops.kernels()
        if lib is None:
            return None
        t, k = top_idx.shape
        idx, w = top_idx.contiguous(), top_w.contiguous()
        out = torch.empty((t, x.shape[1]), dtype=torch.bfloat16)
        gu_c, dn_c = self.gemv_pair()
        rc = lib.pf_moe_experts_few(
            gu_c.address, dn_c.address, x.data_ptr(), x.stride(0), t, k, idx.data_ptr(),
            w.data_ptr(), self.gate_up_proj.data_ptr(), self.down_proj.data_ptr(),
            self.num_experts, x.shape[1], self.inter, out.data_ptr(), torch.get_num_threads())
        return out if rc == 0 else None

    def load_expert(self, e: int, proj: str, tensor: torch.Tensor) -> None:
        """Copy one per-expert checkpoint matrix (``gate_proj``/``up_proj``/``down_proj``)."""
        if self.quantized is not None:
            raise ValueError(f"expert {e} {proj}: a plain weight for quantized experts (the "
                             "checkpoint stores some experts plain, some quantized)")
        if not 0 <= e < self.total_experts:
            raise ValueError(f"expert index {e} out of range for {self.total_experts} experts")
        if self.ep is not None:  # expert parallelism: whole experts, another rank's skipped
            if not self.ep.owns(e):
                return
            e -= self.ep.first
        elif tp_size() > 1:  # the checkpoint's full matrix: this rank's slice of it
            tensor = tensor.narrow(1 if proj == "down_proj" else 0, tp_rank() * self.inter,
                                   self.inter)
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


def _bf16_cpu_rows(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.dim() == 2
               and t.is_contiguous() for t in ts)


def _route_cpu(logits: torch.Tensor, k: int, norm: bool
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The router's softmax top-k on bf16 CPU logits through ``pf_moe_route`` (the native decode
    step calls it too: the same bits on both paths), or None (torch's form)."""
    lib = cpu_ops.kernels()
    if lib is None or not _bf16_cpu_rows(logits) or logits.shape[0] == 0:
        return None
    t, e = logits.shape
    idx = torch.empty((t, k), dtype=torch.int64)
    w = torch.empty((t, k), dtype=torch.bfloat16)
    rc = lib.pf_moe_route(logits.data_ptr(), logits.stride(0), t, e, k, int(norm), idx.data_ptr(),
                          w.data_ptr(), torch.get_num_threads())
    return (w, idx) if rc == 0 else None


def _shared_add_cpu(out: torch.Tensor, shared: torch.Tensor, gate: torch.Tensor | None
                    ) -> torch.Tensor | None:
    """``out + sigmoid(gate) * shared`` (or ``out + shared``) on bf16 CPU rows through
    ``pf_moe_shared_add`` (torch's roundings, the kernels' exp; shared with the native decode
    step), into ``out``'s storage; None (torch's form) otherwise."""
    lib = cpu_ops.kernels()
    if (lib is None or not _bf16_cpu_rows(out, shared) or shared.shape != out.shape
            or (gate is not None and (not _bf16_cpu_rows(gate)
                                      or gate.shape != (out.shape[0], 1)))):
        return None
    rc = lib.pf_moe_shared_add(out.data_ptr(), shared.data_ptr(),
                               gate.data_ptr() if gate is not None else None, 1, out.data_ptr(),
                               out.shape[0], out.shape[1], torch.get_num_threads())
    return out if rc == 0 else None


class SparseMoeBlock(nn.Module):
    """Router + routed experts + optional sigmoid-gated shared expert.

    Parameter names follow transformers (``gate``, ``experts``, ``shared_expert``,
    ``shared_expert_gate``) so checkpoints load by name; the shared expert's gate/up projections
    are fused into ``shared_expert.gate_up_proj`` like every pagefold MLP.
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, moe_inter: int, *,
                 norm_topk_prob: bool, shared_inter: int = 0, shared_gate: bool = True,
                 act: str = "silu", what: str = "moe_intermediate_size") -> None:
        """``what``: the config field of ``moe_inter`` (named when it does not divide)."""
        super().__init__()
        if act != "silu":
            raise ValueError(f"unsupported MoE expert activation {act!r} (only silu)")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in [1, num_experts={num_experts}]")
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = MoEExperts(num_experts, hidden, moe_inter, what)
        # reduce=False: one all-reduce for routed + shared partial sums (see forward).
        self.shared_expert = (GatedMLP(hidden, shared_inter, act=act, reduce=False,
                                       what="shared_expert_intermediate_size")
                              if shared_inter else None)
        self.shared_expert_gate = (nn.Linear(hidden, 1, bias=False)
                                   if shared_inter and shared_gate else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> (top-k weights (T, k) in x's dtype, expert ids (T, k))."""
        logits = self.gate(x)
        routed = _route_cpu(logits, self.top_k, self.norm_topk_prob)
        if routed is not None:
            return routed
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_w, top_idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_w.to(logits.dtype), top_idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_w, top_idx = self.route(x)
        if self.experts.ep is not None:
            return self._forward_ep(x, top_w, top_idx)
        out = self.experts(x, top_idx, top_w)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            gate = self.shared_expert_gate(x) if self.shared_expert_gate is not None else None
            added = _shared_add_cpu(out, shared, gate)
            if added is not None:
                out = added
            else:
                out = out + (torch.sigmoid(gate) * shared if gate is not None else shared)
        return all_reduce(out)

    def _forward_ep(self, x: torch.Tensor, top_w: torch.Tensor, top_idx: torch.Tensor
                    ) -> torch.Tensor:
        """Expert parallelism: the shared expert's partial sum (tensor-parallel) reduced in
        the routed experts' one collective, then added as the one-rank path adds it."""
        shared = self.shared_expert(x) if self.shared_expert is not None else None
        out, shared = self.experts.forward_ep(x, top_idx, top_w, shared)
        if shared is None:
            return out
        gate = self.shared_expert_gate(x) if self.shared_expert_gate is not None else None
        added = _shared_add_cpu(out, shared, gate)
        if added is not None:
            return added
        return out + (torch.sigmoid(gate) * shared if gate is not None else shared)

    def native_record(self, hidden: int) -> tuple | None:
        """The native decode step's record: the kernels this forward calls on decode rows
        (the router's GEMV, ``pf_moe_route``, ``pf_moe_experts_few``, the shared expert and
        its gate, ``pf_moe_shared_add``); None unless they take its weights as they are
        (GEMV-routed linears without biases, bf16 stacked experts, one rank)."""
        ex, sh, gate = self.experts, self.shared_expert, self.shared_expert_gate
        lins = [self.gate, *((sh.gate_up_proj, sh.down_proj) if sh is not None else ()),
                *((gate,) if gate is not None else ())]
        gu_c, dn_c = ex.gemv_pair()
        if not (NATIVE and ex.use_gemv and tp_size() == 1 and ex.quantized is None
                and gu_c.address and dn_c.address
                and all(gemv_ready(lin) and lin.bias is None for lin in lins)
                and self.gate.weight.shape == (ex.num_experts, hidden)
                and all(w.dtype == torch.bfloat16 and w.is_contiguous()
                        for w in (ex.gate_up_proj, ex.down_proj))
                and ex.gate_up_proj.shape[2] == hidden
                and (sh is None or (sh.act is F.silu and sh.gate_up_proj.weight.shape[1] == hidden))
                and (gate is None or gate.weight.shape == (1, hidden))):
            return None
        return "moe", {
            "w0": self.gate.weight.data_ptr(), "n0": ex.num_experts, "top_k": self.top_k,
            "norm_topk": int(self.norm_topk_prob), "experts_gu": ex.gate_up_proj.data_ptr(),
            "experts_down": ex.down_proj.data_ptr(), "moe_inter": ex.inter,
            "shared_gu": sh.gate_up_proj.weight.data_ptr() if sh is not None else 0,
            "shared_down": sh.down_proj.weight.data_ptr() if sh is not None else 0,
            "shared_inter": sh.inter if sh is not None else 0,
            "shared_gate": gate.weight.data_ptr() if gate is not None else 0,
            "g0": gemv_of(self.gate)[0], "g_experts_gu": gu_c.address,
            "g_experts_down": dn_c.address,
            "g_shared_gu": gemv_of(sh.gate_up_proj)[0] if sh is not None else 0,
            "g_shared_down": gemv_of(sh.down_proj)[0] if sh is not None else 0,
            "g_shared_gate": gemv_of(gate)[0] if gate is not None else 0,
            "gemv_rows": min([gu_c.max_rows, dn_c.max_rows] + [gemv_of(m)[1] for m in lins]),
        }, {}

    def native_dyn(self, step: Step) -> list[int]:
        return []


_PER_EXPERT = re.compile(r"^(?P<mod>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                         r"\.weight$")


class ExpertWeightRouter:
    """Takes per-expert checkpoint tensors out of a weight stream and copies them in place.

    ``route(weights)`` yields every other tensor unchanged (for ``load_into``), and so an FP8
    expert ``weight`` of a quantized checkpoint (the model's ``pf_quant`` set: the quantizer
    turns the experts into quantized linears as the tensor loads). Afterwards ``complete()``
    names the stacked parameters every piece of which was loaded this way.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.modules = {n: m for n, m in model.named_modules() if isinstance(m, MoEExperts)}
        self.seen: dict[str, set[tuple[int, str]]] = {}

    def route(self, weights: Iterable[tuple[str, torch.Tensor]]
              ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            m = _PER_EXPERT.match(name)
            quantized = (tensor.dtype == torch.float8_e4m3fn
                         and getattr(self.model, "pf_quant", None) is not None)
            if m is None or m["mod"] not in self.modules or quantized:
                yield name, tensor
                continue
            self.modules[m["mod"]].load_expert(int(m["e"]), m["proj"], tensor)
            self.seen.setdefault(m["mod"], set()).add((int(m["e"]), m["proj"]))

    def complete(self) -> set[str]:
        done = set()
        for mod, seen in self.seen.items():
            n = self.modules[mod].total_experts
            if all((e, p) in seen for e in range(n) for p in ("gate_proj", "up_proj")):
                done.add(f"{mod}.gate_up_proj")
            if all((e, "down_proj") in seen for e in range(n)):
                done.add(f"{mod}.down_proj")
        return done
