"""Lightning attention (MiniMax): linear attention with a per-head exponential decay.

Per request and head ``h`` with decay rate ``s_h > 0``, from ``state[r]`` (D_k x D_v)::

    S_t = exp(-s_h) * S_{t-1} + k_t^T v_t          o_t = q_t S_t          (no softmax, no scale)

Shapes: ``q, k (T, H, Dk)``, ``v (T, H, Dv)``, ``slope (H,)``, ``state (R, H, Dk, Dv)``.
Every variant returns ``(o (T, H, Dv) float32, final states (R, H, Dk, Dv) float32)``.

* :func:`lightning_naive` -- token by token; the reference.
* :func:`lightning_chunked` -- blocks of ``chunk_size`` tokens (transformers' block form): the
  intra-block part ``((q k^T) * decay) v`` with ``decay[i, j] = exp(-s (i - j))`` for ``j <= i``,
  the inter-block part ``(q * exp(-s (i + 1))) S``, then
  ``S <- exp(-s n) S + (k * exp(-s (n - 1 - j)))^T v`` for a block of ``n`` tokens.
* :func:`lightning_recurrent` -- one token per request (decode), all requests at once.
* :func:`lightning_verify` -- the recurrent form step by step over a speculative verify chunk:
  the second result is the state after *every* token, (T, H, Dk, Dv) float32
  (:func:`pagefold.ops.common.stepwise.stepwise`).
"""

from __future__ import annotations

import torch

from pagefold.ops.common.stepwise import stepwise

__all__ = ["lightning_chunked", "lightning_naive", "lightning_recurrent", "lightning_verify"]


def lightning_naive(q, k, v, slope, state, cu_seqlens, *, chunk_size: int = 64):
    del chunk_size
    ratio = torch.exp(-slope.float())[:, None, None]  # (H, 1, 1)
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    out = state.float().clone()
    cu = cu_seqlens.tolist()
    for r in range(len(cu) - 1):
        s = out[r]
        for t in range(cu[r], cu[r + 1]):
            s = ratio * s + k[t].float()[:, :, None] * v[t].float()[:, None, :]
            o[t] = torch.einsum("hk,hkv->hv", q[t].float(), s)
        out[r] = s
    return o, out


def lightning_chunked(q, k, v, slope, state, cu_seqlens, *, chunk_size: int = 64):
    s_rate = slope.float()[:, None, None]  # (H, 1, 1)
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    out = state.float().clone()
    cu = cu_seqlens.tolist()
    pos = torch.arange(chunk_size, device=v.device, dtype=torch.float32)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).tril()
    for r in range(len(cu) - 1):
        s = out[r]  # (H, Dk, Dv)
        for b0 in range(cu[r], cu[r + 1], chunk_size):
            b1 = min(b0 + chunk_size, cu[r + 1])
            n = b1 - b0
            qb = q[b0:b1].float().transpose(0, 1)  # (H, n, Dk)
            kb = k[b0:b1].float().transpose(0, 1)
            vb = v[b0:b1].float().transpose(0, 1)  # (H, n, Dv)
            p = pos[:n]
            diff = (p[:, None] - p[None, :]) * s_rate  # (H, n, n): s (i - j)
            decay = torch.exp(-diff.masked_fill(~causal[:n, :n], float("inf")))
            intra = ((qb @ kb.transpose(1, 2)) * decay) @ vb
            inter = (qb * torch.exp(-s_rate * (p[:, None] + 1))) @ s
            o[b0:b1] = (intra + inter).transpose(0, 1)
            kd = kb * torch.exp(-s_rate * (n - 1 - p[:, None]))
            s = torch.exp(-s_rate * n) * s + kd.transpose(1, 2) @ vb
        out[r] = s
    return o, out


def lightning_recurrent(q, k, v, slope, state, cu_seqlens, *, chunk_size: int = 64):
    """Exactly one token per request (``q`` has R rows)."""
    del chunk_size
    if q.shape[0] != state.shape[0] or cu_seqlens.shape[0] != q.shape[0] + 1:
        raise ValueError("lightning_recurrent takes exactly one token per request")
    ratio = torch.exp(-slope.float())[None, :, None, None]
    s = ratio * state.float() + k.float()[..., None] * v.float()[:, :, None, :]
    return torch.einsum("rhk,rhkv->rhv", q.float(), s), s


# Per-token inputs: q, k, v.
lightning_verify = stepwise(lightning_recurrent, (0, 1, 2))
