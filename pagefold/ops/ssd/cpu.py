"""The compiled Mamba-2 kernels through ctypes: the chunked SSD scan (``csrc/ssd.cpp``) behind
``ssd_chunked``'s contract, and the decode step on paged states (``csrc/mamba2.cpp``).

:func:`ssd_chunked_cpu` takes the arguments of :func:`pagefold.ops.ssd.reference.ssd_chunked`
after its checks (the time step already discretised) and returns ``(y, final_state)`` -- y
(T, H, P) in ``x.dtype``, the final states (S, H, P, N) float32 -- or ``None`` when the kernel
does not take the inputs (not on the CPU, kernels off, dtypes other than float32 / bf16; x
and B / C may differ, as the mixer passes float32 x with bf16 B and C), in which case nothing
was written and the caller runs the torch form. Same chunking (``L`` from the caller), same steps,
results equal to the torch form up to float32 rounding (tested against ``ssd_naive``);
captures are filled as the torch form fills them (see ``state_capture``).
"""

from __future__ import annotations

import torch

from pagefold.csrc.cpu_ops import (
    DTYPE_CODE,
    fresh_flags,
    kernels,
    neg_exp,
    ptr,
    rows_ok,
    state_kernel,
    usable,
)
from pagefold.ops.common.capture import PagedOut

__all__ = ["mamba2_decode", "ssd_chunked_cpu"]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (T, A, B) with each row's A*B elements contiguous (any row stride)."""
    if t.stride(2) == 1 and t.stride(1) == t.shape[2]:
        return t
    return t.contiguous()


def ssd_chunked_cpu(x: torch.Tensor, dtf: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                    C: torch.Tensor, D: torch.Tensor | None, initial_state: torch.Tensor,
                    cu: list[int], L: int, cap: tuple[list[int], torch.Tensor] | None
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Chunked SSD through the kernel. ``dtf`` (T, H) float32 discretised time step, ``cu``
    the host token bounds (S + 1 values), ``L`` the chunk length, ``cap`` the checked capture
    request (flat token indices, out (M, H, P, N) float32 or a ``PagedOut``: written straight
    into the pages) or None."""
    lib = kernels()
    code, bc_code = DTYPE_CODE.get(x.dtype), DTYPE_CODE.get(B.dtype)
    if (lib is None or code is None or bc_code is None or C.dtype != B.dtype
            or any(t.device.type != "cpu" for t in (x, dtf, B, C, initial_state))):
        return None
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    x, B, C = _rows(x), _rows(B), _rows(C)
    if B.stride(0) != C.stride(0):
        B, C = B.contiguous(), C.contiguous()
    dtf = dtf.float().contiguous()
    A32 = A.detach().float().contiguous()
    D32 = D.detach().float().contiguous() if D is not None else None
    init = initial_state.detach().float().contiguous()
    cu_t = torch.tensor(cu, dtype=torch.int64)
    y = torch.empty((T, H, P), dtype=torch.float32)
    final = torch.empty_like(init)
    cap_tok = cap_out = None
    paged: tuple = (None, 0, None, 0, 0)  # pf_ssd_chunked's paged-capture arguments
    if cap:
        cap_tok = torch.tensor(cap[0], dtype=torch.int64)
        if isinstance(cap[1], PagedOut):
            found = cap[1].kernel_args()
            if found is None:
                return None
            pages, paged = found  # pages: kept alive over the call
        else:
            cap_out = cap[1] if cap[1].dtype == torch.float32 and cap[1].is_contiguous() else \
                torch.empty(cap[1].shape, dtype=torch.float32)
    rc = lib.pf_ssd_chunked(
        code, bc_code, x.data_ptr(), x.stride(0), B.data_ptr(), C.data_ptr(), B.stride(0),
        dtf.data_ptr(), dtf.stride(0), A32.data_ptr(),
        D32.data_ptr() if D32 is not None else None, init.data_ptr(), final.data_ptr(),
        cu_t.data_ptr(), len(cu) - 1, y.data_ptr(), H, P, G, N, L,
        cap_tok.data_ptr() if cap_tok is not None else None,
        cap_out.data_ptr() if cap_out is not None else None,
        len(cap[0]) if cap else 0, *paged, torch.get_num_threads())
    if rc != 0:
        return None
    if cap_out is not None and cap_out is not cap[1]:
        cap[1].copy_(cap_out)
    return y.to(x.dtype), final


def mamba2_decode(view, page_ids: torch.Tensor, has_initial_state: torch.Tensor,
                  xbc: torch.Tensor, dt: torch.Tensor, conv_weight: torch.Tensor,
                  conv_bias: torch.Tensor | None, dt_bias: torch.Tensor, A_log: torch.Tensor,
                  D: torch.Tensor, *, num_heads: int, head_dim: int, n_groups: int,
                  state_size: int) -> torch.Tensor | None:
    """A Mamba-2 mixer's decode step (one token per sequence): the conv and the SSM update on
    the states in their pages (read once, written back in place: no gather, no scatter).

    ``xbc`` (N, conv_dim) the conv input, ``dt`` (N, H) the raw time step, ``conv_weight``
    (conv_dim, K); A = ``-exp(A_log)``. Equals ``causal_conv1d_update`` + softplus +
    ``ssd_recurrent`` (with the D term) + storing both states, up to float32 rounding. Returns
    ``y`` (N, H * head_dim) in xbc's dtype, or None when not handled (nothing written): other
    dtypes, a conv window longer than K - 1 (speculative decoding), a non-float32 SSM state.
    """
    found = state_kernel(view)
    if found is None:
        return None
    lib, conv, ssm, offs = found
    n, c = xbc.shape
    k = conv_weight.shape[1]
    code = usable(xbc, dt, conv_weight, *(() if conv_bias is None else (conv_bias,)))
    if (code is None or conv.dtype != xbc.dtype or conv.shape != (c, k - 1)
            or ssm.dtype != torch.float32
            or ssm.shape != (num_heads, head_dim, state_size)
            or not view.raw.is_contiguous() or not rows_ok(xbc) or not rows_ok(dt)
            or not conv_weight.is_contiguous() or page_ids.shape[0] != n):
        return None
    pages = page_ids.contiguous()
    fresh = fresh_flags(has_initial_state)
    small = [dt_bias.detach().float().contiguous(), neg_exp(A_log),
             D.detach().float().contiguous()]
    y = torch.empty((n, num_heads * head_dim), dtype=xbc.dtype)
    rc = lib.pf_mamba2_decode(
        code, ptr(view.raw), view.page_bytes, ptr(pages), pages.shape[1], offs["conv"],
        offs["ssm"], ptr(fresh) if fresh is not None else None, ptr(xbc), xbc.stride(0),
        ptr(dt), dt.stride(0), ptr(conv_weight),
        ptr(conv_bias) if conv_bias is not None else None, *(ptr(t) for t in small),
        ptr(y), n, c, k, num_heads, head_dim, n_groups, state_size, torch.get_num_threads())
    return y if rc == 0 else None
