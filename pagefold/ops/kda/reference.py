"""Kimi Delta Attention (KDA): the gated delta rule with a per-channel decay.

Per request and head, from ``state[r]`` (Dk x Dv), with ``q, k`` L2-normalised (when asked)
and ``q`` scaled by ``Dk ** -0.5``::

    S   <- S * exp(g_t)[:, None]                  g_t (Dk,) <= 0: one decay per key channel
    S   <- S + k_t (beta_t (v_t - k_t S))^T        the delta rule
    o_t  = q_t S

Shapes: ``q, k (T, H, Dk)``, ``v (T, H, Dv)``, ``g (T, H, Dk)``, ``beta (T, H)``,
``state (R, H, Dk, Dv)``. Every variant returns ``(o (T, H, Dv) float32, states (R, H, Dk, Dv)
float32)``; all arithmetic is float32, as in transformers and FLA.

* :func:`kda_naive` -- token by token; the reference.
* :func:`kda_chunked` -- chunks of ``chunk_size`` (transformers' chunk form: the intra-chunk
  delta system solved by forward substitution, the state carried chunk to chunk).
* :func:`kda_recurrent` -- one token per request (decode), all requests at once.
* :func:`kda_verify` -- the recurrent form step by step over a speculative verify chunk: the
  second result is the state after *every* token, (T, H, Dk, Dv) float32
  (:func:`pagefold.ops.common.stepwise.stepwise`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagefold.ops.common.stepwise import stepwise

__all__ = ["kda_chunked", "kda_naive", "kda_recurrent", "kda_verify", "l2norm"]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """FLA's L2 norm: ``x / sqrt(sum x^2 + eps)``."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def _prep(q, k, v, g, beta, use_qk_l2norm: bool):
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def kda_naive(q, k, v, g, beta, state, cu_seqlens, *, use_qk_l2norm: bool = True,
              chunk_size: int = 64):
    del chunk_size
    q, k, v, g, beta = _prep(q, k, v, g, beta, use_qk_l2norm)
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    out = state.float().clone()
    cu = cu_seqlens.tolist()
    for r in range(len(cu) - 1):
        s = out[r]
        for t in range(cu[r], cu[r + 1]):
            s = s * torch.exp(g[t])[..., None]
            delta = (v[t] - torch.einsum("hk,hkv->hv", k[t], s)) * beta[t][:, None]
            s = s + k[t][..., None] * delta[:, None, :]
            o[t] = torch.einsum("hk,hkv->hv", q[t], s)
        out[r] = s
    return o, out


def _chunk_one(q, k, v, g, beta, s, c: int):
    """One request, (H, L, D) inputs, state s (H, Dk, Dv) -> (o (H, L, Dv), s)."""
    n = q.shape[1]
    pad = (c - n % c) % c
    q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
    beta = F.pad(beta, (0, pad))
    h = q.shape[0]
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, v, g, k_beta, v_beta = (t.reshape(h, -1, c, t.shape[-1])
                                  for t in (q, k, v, g, k_beta, v_beta))
    g = g.cumsum(dim=-2)
    dev = q.device
    incl = torch.triu(torch.ones(c, c, dtype=torch.bool, device=dev))
    strict = torch.triu(torch.ones(c, c, dtype=torch.bool, device=dev), diagonal=1)
    decay = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(strict[..., None], float("-inf"))
    decay = decay.exp()  # (H, M, c, c, Dk): exp(g_i - g_j) for j <= i
    a = -(k_beta.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(-1).masked_fill(incl, 0)
    for i in range(1, c):  # forward substitution of the unit lower-triangular system
        row, sub = a[..., i, :i].clone(), a[..., :i, :i].clone()
        a[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
    a = a + torch.eye(c, device=dev)
    u = a @ v_beta
    w = a @ (k_beta * g.exp())
    o = torch.zeros_like(u)
    for m in range(q.shape[1]):
        qm, km, gm = q[:, m], k[:, m], g[:, m]
        intra = (qm.unsqueeze(-2) * km.unsqueeze(-3) * decay[:, m]).sum(-1).masked_fill(strict, 0)
        v_new = u[:, m] - w[:, m] @ s
        o[:, m] = (qm * gm.exp()) @ s + intra @ v_new
        s = s * gm[:, -1].exp().unsqueeze(-1) + (km * (gm[:, -1:] - gm).exp()).transpose(-1, -2) \
            @ v_new
    return o.reshape(h, -1, o.shape[-1])[:, :n], s


def kda_chunked(q, k, v, g, beta, state, cu_seqlens, *, use_qk_l2norm: bool = True,
                chunk_size: int = 64):
    q, k, v, g, beta = _prep(q, k, v, g, beta, use_qk_l2norm)
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    out = state.float().clone()
    cu = cu_seqlens.tolist()
    for r in range(len(cu) - 1):
        a, b = cu[r], cu[r + 1]
        if a == b:
            continue
        o_r, out[r] = _chunk_one(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                 v[a:b].transpose(0, 1), g[a:b].transpose(0, 1),
                                 beta[a:b].transpose(0, 1), out[r], chunk_size)
        o[a:b] = o_r.transpose(0, 1)
    return o, out


def kda_recurrent(q, k, v, g, beta, state, cu_seqlens, *, use_qk_l2norm: bool = True,
                  chunk_size: int = 64):
    """Exactly one token per request (``q`` has R rows)."""
    del chunk_size
    if q.shape[0] != state.shape[0] or cu_seqlens.shape[0] != q.shape[0] + 1:
        raise ValueError("kda_recurrent takes exactly one token per request")
    q, k, v, g, beta = _prep(q, k, v, g, beta, use_qk_l2norm)
    s = state.float() * torch.exp(g)[..., None]
    delta = (v - torch.einsum("rhk,rhkv->rhv", k, s)) * beta[..., None]
    s = s + k[..., None] * delta[:, :, None, :]
    return torch.einsum("rhk,rhkv->rhv", q, s), s


# Per-token inputs: q, k, v, g, beta.
kda_verify = stepwise(kda_recurrent, (0, 1, 2, 3, 4))
