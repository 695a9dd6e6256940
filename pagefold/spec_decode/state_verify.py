"""Committing a speculative verify step of the state layers: the state after the last
accepted token, a select, never a recompute.

A verify step feeds each request ``1 + k`` tokens (the last sampled token and ``k`` drafts).
A recurrent state that absorbed rejected drafts cannot be un-updated, so the verify forms of
the state ops (``*_verify`` in :mod:`pagefold.ops.conv1d`, :mod:`pagefold.ops.gdn`,
:mod:`pagefold.ops.ssd`) return, besides the outputs, ``states[t]`` = the state right after
token ``t`` (flat over the batch, in the layout of the ``cu_seqlens`` batch). With ``a``
drafts accepted for sequence ``s``, the committed state is ``states[cu_seqlens[s] + a]``
(:func:`select_states`); the rejected positions' states are simply dropped. This is
checkpoint-verify-re-advance with the re-advance done by the verify pass itself.
"""

from __future__ import annotations

import torch

__all__ = ["select_states"]


def select_states(states: torch.Tensor, cu_seqlens: torch.Tensor,
                  num_accepted: torch.Tensor | list[int]) -> torch.Tensor:
    """The state after each sequence's last kept token: row ``cu[s] + num_accepted[s]``.

    ``num_accepted[s]`` counts accepted drafts (``0 .. len_s - 1``); every sequence must have
    at least one token in the chunk.
    """
    acc = torch.as_tensor(num_accepted, dtype=torch.long, device=states.device)
    cu = cu_seqlens.to(device=states.device, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]
    if acc.shape != lengths.shape or bool(((acc < 0) | (acc >= lengths)).any()):
        raise ValueError(
            f"num_accepted must be in [0, len) per sequence; got {acc.tolist()} for lengths "
            f"{lengths.tolist()}"
        )
    return states.index_select(0, cu[:-1] + acc)
