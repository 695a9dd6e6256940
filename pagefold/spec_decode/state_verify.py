"""Verify-pass kernels for state layers: the state after *every* new token, so that committing
the accepted prefix of a speculative chunk is a select, never a recompute.

A verify step feeds each request ``1 + k`` tokens (the last sampled token and ``k`` drafts).
A recurrent state that absorbed rejected drafts cannot be un-updated, so these kernels return,
besides the outputs, ``states[t]`` = the state right after token ``t`` (flat over the batch, in
the layout of the ``cu_seqlens`` batch). With ``a`` drafts accepted for sequence ``s``, the
committed state is ``states[cu_seqlens[s] + a]`` (:func:`select_states`); the rejected
positions' states are simply dropped. This is checkpoint-verify-re-advance with the
re-advance done by the verify pass itself.

The math lives in one place: these are the layer kernels of :mod:`pagefold.layers` run with
``per_token_states=True`` (``*_verify_naive``: the naive definitions; ``*_verify``: the
batched forms the engine uses: the varlen conv, the recurrent GDN and SSD scans). Both share
one signature and are tested against the plain kernels run on every prefix of the chunk.
Kernels here never modify their inputs. States come back float32 (GDN, SSD) or in ``x``'s
dtype (conv), as the plain kernels' final states do.
"""

from __future__ import annotations

import torch

from pagefold.layers.causal_conv1d import causal_conv1d_naive, causal_conv1d_varlen
from pagefold.layers.linear_attention.gdn import gdn_naive, gdn_recurrent
from pagefold.layers.mamba.ssd import ssd_naive, ssd_recurrent

__all__ = [
    "causal_conv1d_verify",
    "causal_conv1d_verify_naive",
    "gdn_verify",
    "gdn_verify_naive",
    "select_states",
    "ssd_verify",
    "ssd_verify_naive",
]


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


def _per_token(kernel):
    def verify(*args, **kwargs):
        return kernel(*args, per_token_states=True, **kwargs)

    verify.__name__ = f"{kernel.__name__}_per_token"
    verify.__doc__ = (f"``{kernel.__name__}`` with ``per_token_states=True``: "
                      f"``(outputs, states (T, ...))``, ``states[t]`` after token t.")
    return verify


causal_conv1d_verify_naive = _per_token(causal_conv1d_naive)
causal_conv1d_verify = _per_token(causal_conv1d_varlen)
gdn_verify_naive = _per_token(gdn_naive)
gdn_verify = _per_token(gdn_recurrent)
ssd_verify_naive = _per_token(ssd_naive)
ssd_verify = _per_token(ssd_recurrent)
