"""Routed experts of a many-token bf16 CPU step, grouped: no Python loop over small experts.

:class:`~pagefold.layers.moe.MoEExperts`' general path loops over the experts that drew
tokens, a dozen torch operations each (gather, two products with their row padding, SiLU,
weighting, ``index_add_``): ~150-250 us of host work an expert on a 2-core Xeon, whatever its
rows. A 64-expert top-8 layer over 512 tokens spent most of its 16 ms there, and a 128-expert
layer in a 64-request decode step (4 rows an expert) 36 ms for ~1 ms of products. Here:

1. One stable sort of the positions ``p = token * k + slot`` by expert and one host sync for
   the run lengths (as the general path).
2. Every run of at most ``max_rows`` positions (the rows the chosen GEMVs take) in one C call,
   ``pf_moe_experts_grouped``: gather, the GEMVs, the SiLU kernel, exactly what the few-token
   path computes for such an expert, in parallel over experts; on AMX, runs of up to
   :data:`AMX_MAX_RUN` more in a second call with the tile GEMV (:func:`run_kernels`).
3. Longer runs: the GEMM library's products (``matmul_t``: oneDNN, padded row counts), on
   slices of one gather of the inputs; their compute outgrows the few ops around them.
4. One C call, ``pf_moe_combine``: each token's weighted rows summed in ascending expert order
   into zeros with torch's bf16 roundings (``y * w`` rounded, each add rounded), the general
   path's accumulation; it reads each row at an address (long runs' products in place).

Invariant: a row's expert output is the chosen GEMV's when its run fits ``max_rows``, the
tile GEMV's for runs up to :data:`AMX_MAX_RUN` on AMX (32 where the widths are not multiples
of 32), oneDNN's otherwise; a run's bits never depend on the other experts' runs. Steps of at
most ``max_rows`` tokens never get here (the few-token path).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pagefold.csrc import cpu_ops, gemv_choice
from pagefold.csrc.gemm import matmul_t
from pagefold.ops import elementwise

__all__ = ["grouped_forward", "run_kernels"]

# Past the chosen GEMVs' rows, on AMX (no kernel forced), the tile GEMV takes an expert's run
# of up to AMX_MAX_RUN positions in one call: past 32 rows its blocked path reads each pair of
# weight tiles once per 256 rows and multiplies them with every 16-row group of the run while
# they sit in cache (a row's bits are those of the row alone). An expert run's GEMM is oneDNN
# on weights it reorders on every call (packed copies would double an MoE model's memory)
# plus ~4 torch calls. One layer's routed experts, AMX Xeon, 2 threads, in the same run
# (`python -m benchmarks.moe_experts`, and 8 experts top 2 for fixed run lengths): runs of
# 256-1,024 positions 1.2-1.75x oneDNN's time on 1,024 x 256-384 experts, 0.97-1.07x on
# 2,048 x 512-768 (Qwen3-30B-A3B's experts); 2,048 positions 0.95-1.07x. Pieces of 32 rows
# through the 32-row kernel (before the blocked path) read the weights once per piece: 0.77-
# 0.86x on 2,048 x 768 past 1,024 positions. Runs up to 32: 25 / 47 us at 32 / 64 rows
# (512 x 512, weights hot) against oneDNN's 36 / 45 us before its calls' ~40 us.
AMX_MAX_RUN = 1024
# The tile GEMV multiplies 32 k at a time; other widths go to its dot-product fallback, which
# is no faster than oneDNN past a few dozen rows: runs past AMX_NARROW_RUN take oneDNN then.
AMX_NARROW_RUN = 32
AMX_K_MULTIPLE = 32


def run_kernels(gemv_pair: tuple | None, hidden: int, inter: int
                ) -> list[tuple[tuple, int, int]]:
    """The (gate_up, down) GEMV choices for expert runs and the run lengths each takes, as
    ``[((gu, dn), lo, hi), ...]`` over contiguous ranges from 1: the chosen GEMVs up to the
    smaller of their row limits (what the few-token path computes for such a run), then, where
    AMX runs here and no kernel is forced, the tile GEMV up to :data:`AMX_MAX_RUN` when
    ``hidden`` and ``inter`` are multiples of :data:`AMX_K_MULTIPLE`, else up to
    :data:`AMX_NARROW_RUN`. ``[]`` without GEMVs (every run takes the GEMM)."""
    if gemv_pair is None or gemv_pair[0].fn is None or gemv_pair[1].fn is None:
        return []
    cap = min(gemv_pair[0].max_rows, gemv_pair[1].max_rows)
    out = [(gemv_pair, 1, cap)] if cap >= 1 else []
    tiles = hidden % AMX_K_MULTIPLE == 0 and inter % AMX_K_MULTIPLE == 0
    top = AMX_MAX_RUN if tiles else AMX_NARROW_RUN
    if cap < top and gemv_choice.requested() in ("auto", "flags"):
        amx = _amx_choice(cpu_ops.kernels(), top)
        if amx is not None:
            out.append(((amx, amx), cap + 1, top))
    return out


@functools.cache
def _amx_choice(lib, rows: int) -> gemv_choice.Choice | None:
    """The tile GEMV's choice for runs of up to ``rows`` where it runs here (made once per
    library and row count, not per MoE layer call), else None."""
    if not any(c.name == "amx" for c in gemv_choice.available(lib)):
        return None
    return gemv_choice.make_choice(lib, "amx", rows)


def grouped_forward(x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor,
                    gate_up: torch.Tensor, down: torch.Tensor, gemv_pair: tuple | None
                    ) -> torch.Tensor | None:
    """The routed sum ``(T, hidden)`` for bf16 CPU ``x`` (rows unit stride), ``top_idx`` (T, k)
    int64, ``top_w`` (T, k) bf16 and the stacked contiguous bf16 weights ``gate_up`` (E, 2I, H)
    / ``down`` (E, H, I); ``gemv_pair``: the (gate_up, down) GEMV choices, None for none (every
    run then takes the GEMM). None when the compiled kernels are missing or decline."""
    lib = cpu_ops.kernels()
    if lib is None:
        return None
    t, k = top_idx.shape
    n_exp, hidden, inter = gate_up.shape[0], x.shape[1], down.shape[2]
    flat = top_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # experts ascending, tokens ascending in one
    counts_t = torch.bincount(flat, minlength=n_exp)
    if counts_t.shape[0] != n_exp:  # an id out of range: the general path raises for it
        return None
    starts_t = torch.zeros(n_exp + 1, dtype=torch.int64)
    torch.cumsum(counts_t, 0, out=starts_t[1:])
    counts = counts_t.tolist()  # the one host sync
    threads = torch.get_num_threads()
    ys = torch.empty((t * k, hidden), dtype=torch.bfloat16)
    hi = 0  # runs of 1..hi positions are the GEMVs'
    for (gu_c, dn_c), lo, hi_r in run_kernels(gemv_pair, hidden, inter):
        if any(lo <= n <= hi_r for n in counts):
            rc = lib.pf_moe_experts_grouped(
                gu_c.address, dn_c.address, x.data_ptr(), x.stride(0), k, order.data_ptr(),
                starts_t.data_ptr(), n_exp, lo, hi_r, gate_up.data_ptr(), down.data_ptr(),
                hidden, inter, ys.data_ptr(), threads)
            if rc != 0:
                return None
        hi = hi_r
    big = [e for e, n in enumerate(counts) if n > hi]
    row_bytes = hidden * ys.element_size()
    rows_at = torch.arange(t * k, dtype=torch.int64) * row_bytes + ys.data_ptr()
    keep = []  # long runs' products, read in place by the combine
    if big:
        hx = x.index_select(0, order // k)  # every position's input row, in run order
        starts = starts_t.tolist()
        for e in big:
            s, n = starts[e], counts[e]
            gu = matmul_t(hx[s : s + n], gate_up[e])
            act = elementwise.silu_and_mul(gu)
            if act is None:
                gate, up = gu.split(inter, dim=-1)
                act = F.silu(gate) * up
            y = matmul_t(act, down[e])
            if y.stride(1) != 1 or y.dtype != torch.bfloat16:
                ys[s : s + n] = y
                continue
            keep.append(y)
            rows_at[s : s + n] = (torch.arange(n, dtype=torch.int64)
                                  * (y.stride(0) * y.element_size()) + y.data_ptr())
    out = torch.empty_like(x) if x.is_contiguous() else torch.empty((t, hidden), dtype=x.dtype)
    w = top_w.contiguous()
    if lib.pf_moe_combine(rows_at.data_ptr(), order.data_ptr(), t, k, w.data_ptr(), hidden,
                          out.data_ptr(), threads) != 0:
        return None
    del keep  # the products outlive the combine that reads them
    return out
