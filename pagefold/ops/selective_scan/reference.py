"""Mamba-1 selective scan over a flat varlen batch: naive / chunked / recurrent, one signature.

For each request (tokens ``cu_seqlens[r] : cu_seqlens[r + 1]``), channel ``i`` and state
index ``n``, starting from ``state[r]``::

    dt_t   = softplus(dt_t + dt_bias)          (when dt_softplus; dt_bias optional)
    h_t    = exp(dt_t * A) * h_{t-1} + dt_t * B_t * x_t           h (I, N), float32
    y_t    = sum_n h_t[:, n] * C_t[n] + D * x_t
    y_t   *= silu(z_t)                        (when z is given)

Shapes: ``x, dt, z (T, I)``, ``A (I, N)`` (negative), ``B, C (T, N)``, ``D (I,)``,
``state (R, I, N)``. Every variant returns ``(y (T, I) float32, final states (R, I, N) float32)``
and leaves its inputs untouched.

* :func:`selective_scan_naive` -- token by token; the reference.
* :func:`selective_scan_chunked` -- chunks of ``chunk_size`` tokens per request, all chunks of
  all requests at once: within a chunk a log-depth prefix scan of the affine steps
  ``h -> a h + b``; only the state hand-over between consecutive chunks is sequential.
* :func:`selective_scan_recurrent` -- one token per request (decode), all requests at once.
* :func:`selective_scan_verify` -- the recurrent form step by step over a speculative verify
  chunk: the second result is the state after *every* token, (T, I, N) float32
  (:func:`pagefold.ops.common.stepwise.stepwise`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagefold.ops.common.stepwise import stepwise

__all__ = ["selective_scan_chunked", "selective_scan_naive", "selective_scan_recurrent",
           "selective_scan_verify"]


def _discretise(dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool):
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    return F.softplus(dt) if dt_softplus else dt


def _finish(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None,
            z: torch.Tensor | None) -> torch.Tensor:
    if D is not None:
        y = y + x.float() * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y


def selective_scan_naive(x, dt, A, B, C, D, z, state, cu_seqlens, *, dt_bias=None,
                         dt_softplus=True, chunk_size: int = 16):
    del chunk_size
    dt = _discretise(dt, dt_bias, dt_softplus)
    A = A.float()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    out_state = state.float().clone()
    cu = cu_seqlens.tolist()
    for r in range(len(cu) - 1):
        h = out_state[r]
        for t in range(cu[r], cu[r + 1]):
            h = torch.exp(dt[t, :, None] * A) * h + (dt[t] * x[t].float())[:, None] * B[t].float()
            y[t] = h @ C[t].float()
        out_state[r] = h
    return _finish(y, x, D, z), out_state


def _chunk_index(cu: list[int], chunk: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Every request cut into chunks of ``chunk`` slots: ``idx (M, L)`` token of each slot (T,
    an all-zero padding row, past a request's end), ``req (M,)`` and the chunks per request."""
    rows, req, most = [], [], 0
    for r in range(len(cu) - 1):
        n = 0
        for s0 in range(cu[r], cu[r + 1], chunk):
            rows.append([t if t < cu[r + 1] else -1 for t in range(s0, s0 + chunk)])
            req.append(r)
            n += 1
        most = max(most, n)
    idx = torch.tensor(rows, dtype=torch.long, device=device).reshape(-1, chunk)
    return idx, torch.tensor(req, dtype=torch.long, device=device), most


def selective_scan_chunked(x, dt, A, B, C, D, z, state, cu_seqlens, *, dt_bias=None,
                           dt_softplus=True, chunk_size: int = 64):
    """All chunks of all requests at once (padding slots have dt = 0: no decay, no input);
    only the hand-over of the state from one chunk to the next is sequential."""
    dt = _discretise(dt, dt_bias, dt_softplus)
    A = A.float()
    t_all, i_dim = x.shape
    n_dim = A.shape[1]
    dev = x.device
    out_state = state.float().clone()
    cu = cu_seqlens.tolist()
    if t_all == 0:
        return torch.empty(0, i_dim, device=dev), out_state
    idx, req, most = _chunk_index(cu, chunk_size, dev)
    pad = idx < 0
    safe = idx.clamp(min=0)
    d = dt[safe].masked_fill(pad[..., None], 0.0)  # (M, L, I)
    xv = x.float()[safe]
    bv, cv = B.float()[safe], C.float()[safe]  # (M, L, N)
    # Within each chunk, from a zero state: h_t = a_t h_{t-1} + b_t with a = exp(dt A), b = dt B x.
    # A log-depth prefix scan composes (a, b) pairs: (a1, b1) then (a2, b2) = (a1 a2, a2 b1 + b2);
    # products of decays never exceed 1, so no step can overflow.
    a = torch.exp(d[..., None] * A)  # (M, L, I, N)
    b = (d * xv)[..., None] * bv[:, :, None, :]
    m_all, ln = idx.shape
    k = 1
    while k < ln:
        a_prev, b_prev = a[:, :-k], b[:, :-k]
        b = torch.cat((b[:, :k], a[:, k:] * b_prev + b[:, k:]), dim=1)
        a = torch.cat((a[:, :k], a[:, k:] * a_prev), dim=1)
        k *= 2
    total, chunk_in = a[:, -1], b[:, -1]  # (M, I, N): the whole chunk's decay and input
    # Hand the state over chunk by chunk: h0 of every chunk, all requests in step.
    h0 = torch.empty(m_all, i_dim, n_dim, device=dev)
    first = torch.zeros(len(cu) - 1, dtype=torch.long, device=dev)
    counts = torch.bincount(req, minlength=len(cu) - 1)
    first[1:] = torch.cumsum(counts, 0)[:-1]
    h = out_state
    for j in range(most):
        live = (counts > j).nonzero().flatten()
        m = first[live] + j
        h0[m] = h[live]
        h = h.clone()
        h[live] = total[m] * h[live] + chunk_in[m]
    out_state = h
    y_chunks = torch.einsum("mtin,mtn->mti", a * h0[:, None] + b, cv)
    y = torch.empty(t_all, i_dim, device=dev)
    y[idx[~pad]] = y_chunks[~pad]
    return _finish(y, x, D, z), out_state


def selective_scan_recurrent(x, dt, A, B, C, D, z, state, cu_seqlens, *, dt_bias=None,
                             dt_softplus=True, chunk_size: int = 16):
    """Exactly one token per request (``x`` has R rows)."""
    del chunk_size
    if x.shape[0] != state.shape[0] or cu_seqlens.shape[0] != x.shape[0] + 1:
        raise ValueError("selective_scan_recurrent takes exactly one token per request")
    dt = _discretise(dt, dt_bias, dt_softplus)  # (R, I)
    h = (torch.exp(dt[:, :, None] * A.float()) * state.float()
         + (dt * x.float())[:, :, None] * B.float()[:, None, :])
    y = torch.einsum("rin,rn->ri", h, C.float())
    return _finish(y, x, D, z), h


# Per-token inputs: x, dt, B, C, z.
selective_scan_verify = stepwise(selective_scan_recurrent, (0, 1, 3, 4, 6))
