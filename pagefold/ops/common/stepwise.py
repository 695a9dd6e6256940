"""The verify form of a recurrent (one token per request) state kernel, by token offset.

A speculative verify step feeds each request ``1 + k`` tokens and needs the state after every
one of them (the commit selects the accepted one,
:func:`pagefold.spec_decode.state_verify.select_states`). :func:`stepwise` builds that form
from a kernel's decode form: at offset ``j = 0, 1, ...`` it runs the decode form once on the
requests that still have a token at ``j`` (their ``j``-th tokens, their states so far), so a
verify chunk computes exactly the arithmetic of ``1 + k`` consecutive decode steps (what the
same request runs without speculation), for ``max(len)`` calls instead of ``T``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["stepwise"]


def stepwise(recurrent: Callable[..., tuple[torch.Tensor, torch.Tensor]],
             token_args: tuple[int, ...]) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The verify form of ``recurrent``: same signature, returns ``(outputs (T, ...),
    states (T, ...) float32)`` with ``states[t]`` the state right after flat token ``t``.

    ``recurrent(*inputs, state (R, ...), cu_seqlens, **kw)`` must take exactly one token per
    request and return ``(outputs (R, ...), new states (R, ...))``; the positional inputs at
    ``token_args`` are per-token tensors (T, ...) (or None), the others are passed unchanged.
    Requests may have any number of tokens, zero included.
    """
    def verify(*args, **kwargs):
        *inputs, state, cu_seqlens = args
        cu = [int(c) for c in cu_seqlens.tolist()]
        lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        dev = state.device
        h = state.float().clone()
        out: torch.Tensor | None = None
        states = torch.empty((cu[-1], *h.shape[1:]), dtype=torch.float32, device=dev)
        for j in range(max(lens, default=0) or 1):
            live = [r for r, n in enumerate(lens) if n > j]
            req = torch.tensor(live, dtype=torch.long, device=dev)
            tok = torch.tensor([cu[r] + j for r in live], dtype=torch.long, device=dev)
            sub = [a[tok] if i in token_args and a is not None else a
                   for i, a in enumerate(inputs)]
            one = torch.arange(len(live) + 1, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
            o, new = recurrent(*sub, h[req], one, **kwargs)
            if out is None:  # shaped by the kernel (an empty step still runs once, on 0 rows)
                out = o.new_empty((cu[-1], *o.shape[1:]))
            out[tok] = o
            h[req] = new.float()
            states[tok] = new.float()
        return out, states

    verify.__name__ = verify.__qualname__ = f"{recurrent.__name__}_stepwise"
    verify.__doc__ = f"The verify form of ``{recurrent.__name__}`` (see stepwise)."
    return verify
