"""The compiled chunked SSD scan (``pagefold/csrc/ssd.cpp``) behind ``ssd_chunked``'s contract.

:func:`ssd_chunked_cpu` takes the arguments of :func:`pagefold.layers.mamba.ssd.ssd_chunked`
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

from pagefold.csrc import cpu_ops
from pagefold.layers.state_capture import PagedOut

__all__ = ["ssd_chunked_cpu"]

_CODE = {torch.float32: 0, torch.bfloat16: 1}


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
    lib = cpu_ops.kernels()
    code, bc_code = _CODE.get(x.dtype), _CODE.get(B.dtype)
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
