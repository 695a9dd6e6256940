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

from pagefold.ops.common.capture import check_capture

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
        shaped as one state of ``final``; see :mod:`pagefold.ops.common.capture`)."""
        if capture is None:
            return None
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


def seq_args(cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor | None,
             device: torch.device, cu_dtype: torch.dtype = torch.int64
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' ``(cu, init)`` arguments: ``cu_seqlens`` on ``device``, and the int8
    fresh-or-not flags (``cu`` as a dummy pointer when every sequence is read as it is)."""
    cu = cu_seqlens.to(device, cu_dtype).contiguous()
    init = has_initial_state.to(device, torch.int8).contiguous() \
        if has_initial_state is not None else cu
    return cu, init


@triton.jit
def tile_row(M, r, i):
    """Row ``i`` of a (BLOCK_C, X) register tile whose row indices are ``r`` (no slicing in
    Triton: a masked reduction)."""
    return tl.sum(tl.where(r[:, None] == i, M, 0.0), 0)


def chunk_prec(dtype: torch.dtype) -> str:
    """``tl.dot`` precision of the chunked kernels. Tiles stay float32 (the WY inverse loses
    too much in bf16). Half models on a GPU: tf32 tensor cores; float32 models: 3xTF32
    (float32-level products on tensor cores; "ieee" compiles these 64-row dots to FMA loops:
    minutes of ptxas, measured 205 s for sm_90)."""
    if INTERPRET:
        return "ieee"
    return "tf32x3" if dtype == torch.float32 else "tf32"


def block_chunk(chunk_size: int) -> int:
    """The chunk length the kernels use for ``chunk_size``: a power of two in [16, 64]."""
    return pow2(min(chunk_size, 64), 16)


def prefill_chunk_size(t: int, n: int, largest: int = 64) -> int:
    """Chunk length of the chunked kernels for ``t`` tokens over ``n`` sequences: the
    longest a sequence can be (``t - n + 1``, known without a host sync) rounded up to a power
    of two, between 16 (``tl.dot``'s smallest tile) and ``largest``: chunked prefill steps of
    a few tokens per request do not pay for 64-row chunks of padding."""
    return min(largest, pow2(t - n + 1, 16))


def chunk_layout(cu_seqlens: torch.Tensor, chunk_size: int,
                 start_pos: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """``(chunk_offsets (N,) int64, M)``: sequence ``s``'s chunks are rows
    ``chunk_offsets[s] ..`` of a ``chunk_states`` capture of ``M`` rows (a host sync)."""
    cu = cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    shift = start_pos.to(cu.device, torch.int64) % chunk_size if start_pos is not None else 0
    n = torch.where(lens > 0, (lens + shift + chunk_size - 1) // chunk_size, 0)
    offs = torch.cumsum(n, 0) - n
    return offs, int(n.sum())


def dense_chunk_offsets(cu_seqlens: torch.Tensor, chunk_size: int,
                        start_pos: torch.Tensor | None, chunk_states: torch.Tensor | None
                        ) -> torch.Tensor | None:
    """The dense-signature chunked kernels' ``chunk_offsets`` for a ``chunk_states`` capture
    (None without one), checking that it has the rows :func:`chunk_layout` asks for."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if chunk_states is None:
        return None
    coff, m = chunk_layout(cu_seqlens, block_chunk(chunk_size), start_pos)
    if chunk_states.shape[0] < m:
        raise ValueError(f"chunk_states needs {m} rows, has {chunk_states.shape[0]}")
    return coff


def chunk_args(cu: torch.Tensor, start_pos: torch.Tensor | None,
               chunk_offsets: torch.Tensor | None, chunk_states: torch.Tensor | None,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked kernels' ``(start positions, chunk offsets)`` pointers (``cu`` as the
    dummy where absent); raises when ``chunk_states`` comes without its offsets."""
    if chunk_states is not None and chunk_offsets is None:
        raise ValueError("chunk_states needs chunk_offsets (see chunk_layout)")
    pos = start_pos.to(device, torch.int64).contiguous() if start_pos is not None else cu
    coff = chunk_offsets.to(device, torch.int64).contiguous() \
        if chunk_offsets is not None else cu
    return pos, coff
