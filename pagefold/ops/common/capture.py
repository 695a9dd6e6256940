"""State checkpoints captured inside the prefill kernels (conv window, GDN, Mamba-2 SSD).

Prefix caching for hybrids saves the recurrent state at chosen prefix lengths (checkpoint
targets). Instead of ending a prefill chunk at every target (one extra engine step per
target), the kernels take a *capture* request: for each capture ``m`` the flat index
``after[m]`` of the last token the state must include, and write the state right after that
token into ``out[m]``. Every kernel of a triple (naive / chunked / recurrent) accepts the same
``capture=(after, out)`` keyword and fills ``out`` with what a kernel call ending after token
``after[m]`` would have returned as that sequence's final state.

The chunked kernels never change their chunking for a capture (so outputs and final states
are bitwise those of the call without captures). A capture at the last real token of a chunk
is that chunk's exit state; one inside a chunk is computed from the chunk's entry state with
the same exit-state formula cut after the captured row (the intra-chunk terms of later rows
drop out), see ``ssd_chunked`` and ``gdn_chunked``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Capture", "PagedOut", "capture_plan", "check_capture", "per_token", "seq_of"]


@dataclass(frozen=True, slots=True)
class PagedOut:
    """A capture destination in the paged cache instead of a buffer: ``out[m]`` is component
    ``name`` of the state over the pages ``page_ids[m]`` of ``view`` (a
    :class:`pagefold.executor.cache_tensors.StateView`). A compiled kernel writes the captures
    there directly (one copy instead of three); a torch kernel fills a buffer that
    :meth:`write` stores. Only kernels that say so accept it (``check_capture(paged=True)``).
    """

    view: Any
    page_ids: torch.Tensor  # (M, pages_per_state) int64
    name: str

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.page_ids.shape[0], *self.view.spec.component(self.name).shape)

    @property
    def offset(self) -> int:
        """Byte offset of the component in a state's concatenated pages."""
        return self.view.offset(self.name)

    @property
    def dtype(self) -> torch.dtype:
        return self.view.spec.component(self.name).dtype

    def buffer(self) -> torch.Tensor:
        """A buffer (the component's dtype) for a kernel to fill, then :meth:`write`."""
        return torch.empty(self.shape, dtype=self.dtype, device=self.view.raw.device)

    def write(self, states: torch.Tensor) -> None:
        self.view.write_component(self.page_ids, self.name, states)

    def kernel_args(self) -> tuple[torch.Tensor, tuple[int, int, int, int, int]] | None:
        """What a compiled kernel takes to write into the pages: ``(pages, (raw address, page
        bytes, pages address, pages per state, offset))``, ``pages`` the int64 page ids to keep
        alive over the call; None when the pool is not a contiguous CPU tensor."""
        raw = self.view.raw
        if raw.device.type != "cpu" or not raw.is_contiguous():
            return None
        pages = self.page_ids.to(torch.int64).contiguous()
        return pages, (raw.data_ptr(), raw.shape[1], pages.data_ptr(), pages.shape[1],
                       self.offset)


# (after (M,) int64 flat token indices, out: an (M, ...) float32 buffer the kernel fills, or
# a PagedOut for the kernels that take one)
Capture = tuple[torch.Tensor, "torch.Tensor | PagedOut"]


def check_capture(capture: Capture | None, total: int, state_shape: tuple[int, ...],
                  paged: bool = False) -> tuple[list[int], torch.Tensor | PagedOut] | None:
    """Validate a capture request; returns ``(after as a list, out)`` or None. ``paged``:
    the caller accepts a :class:`PagedOut` (a component of ``state_shape``; its dtype is the
    caller's to check)."""
    if capture is None:
        return None
    after, out = capture
    idx = [int(a) for a in after.reshape(-1).tolist()]
    if any(not 0 <= a < total for a in idx):
        raise ValueError(f"capture positions must lie in [0, {total}), got {idx}")
    if isinstance(out, PagedOut) and not paged:
        raise TypeError("this kernel takes a capture buffer, not a PagedOut")
    if tuple(out.shape) != (len(idx), *state_shape):
        raise ValueError(f"capture out must be {(len(idx), *state_shape)}, "
                         f"got {tuple(out.shape)}")
    return idx, out


def seq_of(cu: list[int], after: list[int]) -> list[tuple[int, int]]:
    """``(sequence, local offset)`` of each flat token index (non-empty sequences own them)."""
    res = []
    for a in after:
        s = bisect.bisect_right(cu, a) - 1
        while cu[s + 1] == cu[s]:  # skip empty sequences starting at the same index
            s += 1
        res.append((s, a - cu[s]))
    return res


def capture_plan(cu: list[int], after: list[int], order: list[int], chunk: int = 1
                 ) -> tuple[dict[int, list[tuple[int, ...]]], dict[int, list[tuple[int, ...]]]]:
    """Where a scan over the sequences in ``order`` (rank ``r``: sequence ``order[r]``) takes
    its captures, keyed by step (a chunk position; a token offset with ``chunk=1``):
    ``at_end[j]`` lists ``(capture, rank)`` whose token is the last of chunk ``j``'s real ones
    (the state after step ``j``), ``at[j]`` lists ``(capture, rank, row)`` inside chunk ``j``."""
    rank = {s: r for r, s in enumerate(order)}
    at: dict[int, list[tuple[int, ...]]] = {}
    at_end: dict[int, list[tuple[int, ...]]] = {}
    for m, (s, off) in enumerate(seq_of(cu, after)):
        if off % chunk == chunk - 1 or off == cu[s + 1] - cu[s] - 1:
            at_end.setdefault(off // chunk, []).append((m, rank[s]))
        else:
            at.setdefault(off // chunk, []).append((m, rank[s], off % chunk))
    return at, at_end


def per_token(kernel: Callable[..., tuple]) -> Callable[..., tuple]:
    """``kernel`` (a naive or recurrent form) with ``per_token_states=True``: the verify form,
    ``(outputs, states (T, ...))`` with ``states[t]`` the state right after flat token ``t``
    (a speculative verify step's; the commit selects the accepted one,
    :func:`pagefold.spec_decode.state_verify.select_states`)."""
    def verify(*args, **kwargs):
        return kernel(*args, per_token_states=True, **kwargs)

    verify.__name__ = verify.__qualname__ = f"{kernel.__name__}_per_token"
    verify.__doc__ = f"``{kernel.__name__}`` with ``per_token_states=True`` (see per_token)."
    return verify
