"""State checkpoints captured inside the prefill kernels (conv window, GDN, Mamba-2 SSD).

Prefix caching for hybrids saves the recurrent state at chosen prefix lengths (checkpoint
targets). Instead of ending a prefill chunk at every target (one extra engine step per
target), the kernels take a *capture* request: for each capture ``m`` the flat index
``after[m]`` of the last token the state must include, and write the state right after that
token into ``out[m]``. Every kernel of a triple (naive / chunked / recurrent) accepts the same
``capture=(after, out)`` keyword and fills ``out`` with what a kernel call ending after token
``after[m]`` would have returned as that sequence's final state.

The chunked kernels get exact chunk boundaries at captures by *virtual padding*: inside one
sequence, the tokens from a capture boundary on are shifted right so that the boundary lands
on a chunk boundary; the gap is filled with padding tokens, which the chunked kernels already
define as neutral (no decay, no write). The state after the chunk that ends at the boundary is
then exactly the state a call cut there would return, and the carried state continues
unchanged into the next chunk.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

__all__ = ["Capture", "CaptureLayout", "capture_layout", "check_capture"]

# (after (M,) int64 flat token indices, out (M, ...) float32 buffer the kernel fills)
Capture = tuple[torch.Tensor, torch.Tensor]


def check_capture(capture: Capture | None, total: int, state_shape: tuple[int, ...]
                  ) -> tuple[list[int], torch.Tensor] | None:
    """Validate a capture request; returns ``(after as a list, out)`` or None."""
    if capture is None:
        return None
    after, out = capture
    idx = [int(a) for a in after.reshape(-1).tolist()]
    if any(not 0 <= a < total for a in idx):
        raise ValueError(f"capture positions must lie in [0, {total}), got {idx}")
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


@dataclass(slots=True)
class CaptureLayout:
    """Virtual positions of one call's tokens with every capture boundary chunk-aligned.

    ``shift[t]``: padding slots inserted before token ``t`` inside its sequence;
    ``vlens[s]``: sequence ``s``'s virtual length; ``chunk_of[m]``: ``(sequence, index of the
    chunk that ends exactly at capture m's boundary)``.
    """

    shift: torch.Tensor
    vlens: list[int]
    chunk_of: list[tuple[int, int]]


def capture_layout(cu: list[int], after: list[int], chunk: int,
                   device: torch.device | str = "cpu") -> CaptureLayout:
    """Pad each sequence so that the boundary after every captured token is a multiple of
    ``chunk`` in virtual positions (boundaries in order; each pad shifts all later tokens)."""
    total = cu[-1]
    shift = torch.zeros(total, dtype=torch.long)
    lens = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    vlens = list(lens)
    bounds: dict[int, set[int]] = {}
    for s, off in seq_of(cu, after):
        bounds.setdefault(s, set()).add(off + 1)
    chunk_at: dict[tuple[int, int], int] = {}
    for s, bs in bounds.items():
        acc = 0
        for b in sorted(bs):
            pad = (-(b + acc)) % chunk
            if pad and b < lens[s]:
                shift[cu[s] + b : cu[s + 1]] += pad
            acc += pad
            chunk_at[(s, b)] = (b + acc) // chunk - 1
        vlens[s] = lens[s] + acc
    chunk_of = [(s, chunk_at[(s, off + 1)]) for s, off in seq_of(cu, after)]
    return CaptureLayout(shift.to(device), vlens, chunk_of)
