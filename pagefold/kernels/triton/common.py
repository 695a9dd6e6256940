"""Shared helpers of the Triton kernels: interpreter detection, block sizes, dtype mapping,
and the addressing of a state that lives in pages.

A state component (e.g. a GDN layer's ``ssm`` state) of request ``n`` is the concatenation of
its ``pages_per_state`` page rows, cut at the spec's byte offset. Viewed as elements of the
component's dtype, element ``e`` of the component sits in page ``pages[n, (OFF + e) // PE]``
at ``(OFF + e) % PE``, with ``PE`` elements per page and ``OFF`` the offset in elements. The
kernels compute that address per element, so states are read and written in place, whatever
the number of pages. A dense ``(N, ...)`` state is the special case of one page per request
with ``pages = arange(N)`` and ``OFF = 0``: the dense-signature wrappers reuse the same
kernels that way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pow2(n: int, lo: int = 1) -> int:
    """Smallest power of two >= max(n, lo) (Triton block shapes are powers of two)."""
    return max(lo, triton.next_power_of_2(max(int(n), 1)))


def dot_dtype(dtype: torch.dtype):
    """Operand dtype of ``tl.dot``: bf16/fp16 operands on a GPU (the tensor-core path, exact
    products, float32 sums); float32 everywhere under the interpreter, whose ``tl.dot`` is
    wrong for bf16 operands (measured with Triton 3.9; bf16 products are exact in float32, so
    the result is the same)."""
    if INTERPRET or dtype == torch.float32:
        return tl.float32
    return tl.bfloat16 if dtype == torch.bfloat16 else tl.float16


def tl_dtype(dtype: torch.dtype):
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16,
            torch.float16: tl.float16}[dtype]


@dataclass(frozen=True, slots=True)
class PagedState:
    """One state component addressed in pages: ``base`` is the pool viewed as elements of the
    component's dtype (flat), ``pages`` (N, pages_per_state) int64 page ids, ``page_elems``
    elements per page and ``offset`` the component's first element within a state."""

    base: torch.Tensor
    pages: torch.Tensor
    page_elems: int
    offset: int

    @staticmethod
    def dense(state: torch.Tensor) -> PagedState:
        """A dense (N, ...) contiguous state as N one-page states."""
        n = state.shape[0]
        per = state[0].numel() if n else 1
        pages = torch.arange(n, dtype=torch.int64, device=state.device).view(n, 1)
        return PagedState(state.reshape(-1), pages, max(per, 1), 0)

    @staticmethod
    def from_view(view, name: str, page_ids: torch.Tensor) -> PagedState | None:
        """Component ``name`` of a :class:`~pagefold.executor.cache_tensors.StateView`, or
        None when the pool cannot be viewed in its dtype (unaligned offset or page size)."""
        spec = view.spec
        comp = spec.component(name)
        off = dict(zip((c.name for c in spec.components), spec.offsets))[name]
        size = comp.dtype.itemsize
        if view.page_bytes % size or off % size or not view.raw.is_contiguous():
            return None
        base = view.raw.view(comp.dtype).reshape(-1)
        return PagedState(base, page_ids.to(torch.int64).contiguous(), view.page_bytes // size,
                          off // size)


@triton.jit
def state_addr(pages_ptr, n, pages_per_state, page_elems, offset, e, mask):
    """Flat element addresses of elements ``e`` (an int tensor; ``mask`` the valid ones) of
    request ``n``'s state component."""
    g = offset + e
    page = tl.load(pages_ptr + n * pages_per_state + g // page_elems, mask=mask, other=0)
    return page.to(tl.int64) * page_elems + (g % page_elems)


@triton.jit
def has_pages(pages_ptr, n, pages_per_state):
    """False for a padding row (negative first page id: nothing is read or written)."""
    return tl.load(pages_ptr + n * pages_per_state) >= 0


@triton.jit
def gate(mask, flag):
    """``mask & flag`` for a block ``mask`` and a scalar bool ``flag`` (written as an int
    comparison: Triton's interpreter rejects the bool mask a scalar-block ``&`` gives)."""
    return mask & ((mask.to(tl.int32) * 0 + flag.to(tl.int32)) > 0)


@triton.jit
def load_state(st_ptr, pages_ptr, init_ptr, n, pages_per_state, page_elems, offset, e, mask,
               HAS_INIT: tl.constexpr):
    """Request ``n``'s state tile (elements ``e``) from its pages as float32, zeros for a fresh
    sequence (``init_ptr[n] == 0`` with ``HAS_INIT``) or a padding row; also whether the row
    is live (has pages: its final state is written back with :func:`store_state`)."""
    live = has_pages(pages_ptr, n, pages_per_state)
    use_state = live
    if HAS_INIT:
        use_state = use_state & (tl.load(init_ptr + n) != 0)
    lm = gate(mask, use_state)
    state = tl.load(st_ptr + state_addr(pages_ptr, n, pages_per_state, page_elems, offset, e,
                                        lm), mask=lm, other=0.0).to(tl.float32)
    return state, live


@triton.jit
def store_state(st_ptr, pages_ptr, n, pages_per_state, page_elems, offset, e, mask, live,
                state):
    """Write a live row's state tile back into its pages (in the pool's dtype)."""
    sm = gate(mask, live)
    tl.store(st_ptr + state_addr(pages_ptr, n, pages_per_state, page_elems, offset, e, sm),
             state.to(st_ptr.dtype.element_ty), mask=sm)


@dataclass(frozen=True, slots=True)
class Captures:
    """States to capture inside a chunked kernel (prefix-cache checkpoints within a step).

    ``after`` (M,) int64: flat token indices, ascending (so each sequence's captures are a
    run); ``cu`` (N+1,) int64: sequence ``s`` owns captures ``cu[s]:cu[s+1]``; ``seq`` (M,)
    their sequences; ``target``: capture ``m``'s state goes to row ``m`` of it (the
    checkpoint's pages in the pool, or a dense (M, ...) tensor)."""

    after: torch.Tensor
    cu: torch.Tensor
    seq: torch.Tensor
    target: PagedState

    @staticmethod
    def build(cu_seqlens: torch.Tensor, after: torch.Tensor, target: PagedState) -> Captures:
        """Sort ``after`` (any order; ``target.pages`` row ``m`` belongs to ``after[m]``)."""
        cu = cu_seqlens.to(after.device, torch.int64)
        srt, perm = after.to(torch.int64).sort()
        pages = target.pages[perm].contiguous()
        seq = torch.searchsorted(cu[1:], srt, right=True)
        return Captures(srt.contiguous(), torch.searchsorted(srt, cu).contiguous(),
                        seq.contiguous(),
                        PagedState(target.base, pages, target.page_elems, target.offset))

    @staticmethod
    def dense(cu_seqlens: torch.Tensor, capture: tuple[torch.Tensor, torch.Tensor] | None,
              final: torch.Tensor) -> Captures | None:
        """The dense-signature kernels' ``capture=(after, out)`` (``out`` (M, ...) float32,
        shaped as one state of ``final``; see :mod:`pagefold.layers.state_capture`)."""
        if capture is None:
            return None
        from pagefold.layers.state_capture import check_capture

        after, out = capture
        check_capture(capture, int(cu_seqlens[-1]), tuple(final.shape[1:]))
        if out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError("capture out must be a contiguous float32 tensor")
        return Captures.build(cu_seqlens, after.to(out.device), PagedState.dense(out))

    @staticmethod
    def args(caps: Captures | None, dummy: torch.Tensor) -> tuple:
        """The kernels' capture arguments (``cap, cap_cu, base, pages, pps, page_elems,
        offset``); ``dummy`` pointers when there is nothing to capture."""
        if caps is None:
            return dummy, dummy, dummy, dummy, 1, 1, 0
        t = caps.target
        return caps.after, caps.cu, t.base, t.pages, t.pages.shape[1], t.page_elems, t.offset
