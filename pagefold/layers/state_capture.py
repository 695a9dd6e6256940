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

import torch

__all__ = ["Capture", "check_capture", "seq_of"]

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
