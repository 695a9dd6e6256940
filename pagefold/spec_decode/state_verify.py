"""Verify-pass kernels for state layers: the state after *every* new token, so that committing
the accepted prefix of a speculative chunk is a select, never a recompute.

A verify step feeds each request ``1 + k`` tokens (the last sampled token and ``k`` drafts).
A recurrent state that absorbed rejected drafts cannot be un-updated, so these kernels return,
besides the outputs, ``states[t]`` = the state right after token ``t`` (flat over the batch, in
the layout of the ``cu_seqlens`` batch). With ``a`` drafts accepted for sequence ``s``, the
committed state is ``states[cu_seqlens[s] + a]`` (:func:`select_states`); the rejected
positions' states are simply dropped. This is checkpoint-verify-re-advance with the
re-advance done by the verify pass itself.

Triples as elsewhere: ``*_verify_naive`` is the definition (per sequence, per token, built on
the existing naive steps), ``*_verify`` the batched form used by the engine; both share one
signature and are tested against the plain kernels run on every prefix of the chunk.

Kernels here never modify their inputs. States come back float32 (GDN, SSD) or in ``x``'s
dtype (conv), as the plain kernels' final states do.
"""

from __future__ import annotations

import math

import torch

from pagefold.layers.causal_conv1d import _activate, _check_args
from pagefold.layers.linear_attention.gdn import _prepare
from pagefold.layers.linear_attention.gdn import _step as _gdn_step
from pagefold.layers.linear_attention.gdn import _step_fused as _gdn_step_fused
from pagefold.layers.mamba.ssd import _check_inputs, _discretize_dt, _heads_view, _seq_bounds
from pagefold.layers.mamba.ssd import _step as _ssd_step

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


# ----------------------------------------------------------------------------- conv


def causal_conv1d_verify_naive(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token loop; returns ``(y (T, C), states (T, C, K-1))``, ``states[t]`` after token t."""
    _check_args(x, weight, conv_state, activation)
    w = weight.float()
    b = bias.float() if bias is not None else None
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    states = torch.empty((x.shape[0], *conv_state.shape[1:]), dtype=x.dtype, device=x.device)
    bounds = cu_seqlens.tolist()
    for s in range(len(bounds) - 1):
        history = conv_state[s].float()
        for t in range(bounds[s], bounds[s + 1]):
            window = torch.cat([history, x[t].float().unsqueeze(1)], dim=1)
            out = (window * w).sum(dim=1)
            if b is not None:
                out = out + b
            y[t] = _activate(out, activation)
            history = window[:, 1:]
            states[t] = history.to(x.dtype)
    return y.to(x.dtype), states


def causal_conv1d_verify(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched: each sequence's state then its tokens in one extended buffer (the window of
    ``K-1+len`` rows the spec-aware conv cache holds); one depthwise conv gives every output,
    and the state after token ``t`` is the ``K-1`` columns ending at ``t``'s column.
    """
    channels, kernel = _check_args(x, weight, conv_state, activation)
    hist = kernel - 1
    num_seqs = cu_seqlens.numel() - 1
    if conv_state.shape[0] != num_seqs:
        raise ValueError(f"conv_state has {conv_state.shape[0]} rows for {num_seqs} sequences")
    device = x.device
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    total = x.shape[0]
    tok = torch.arange(total, device=device)
    seg = torch.searchsorted(cu[1:], tok, right=True)
    tok_pos = tok + (seg + 1) * hist  # column of token t in the extended buffer
    seq_ids = torch.arange(num_seqs, device=device)
    state_pos = ((cu[:-1] + seq_ids * hist).unsqueeze(1)
                 + torch.arange(hist, device=device)).reshape(-1)
    ext = torch.empty(channels, total + num_seqs * hist, dtype=torch.float32, device=device)
    ext[:, tok_pos] = x.float().t()
    ext[:, state_pos] = conv_state.float().permute(1, 0, 2).reshape(channels, -1)
    out = torch.nn.functional.conv1d(
        ext.unsqueeze(0), weight.float().unsqueeze(1),
        bias.float() if bias is not None else None, groups=channels,
    ).squeeze(0)
    y = _activate(out[:, tok_pos - hist], activation).t()
    cols = tok_pos.unsqueeze(1) - hist + 1 + torch.arange(hist, device=device)  # (T, K-1)
    states = ext[:, cols.reshape(-1)].reshape(channels, total, hist).permute(1, 0, 2)
    return y.to(x.dtype).contiguous(), states.to(x.dtype).contiguous()


# ----------------------------------------------------------------------------- GDN


def gdn_verify_naive(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor, cu_seqlens: torch.Tensor, *, scale: float | None = None,
    use_qk_l2norm: bool = True, chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Definition: ``(o (T, H, Dv), states (T, H, Dk, Dv) float32)``."""
    del chunk_size
    qf, kf, vf, gf, bf, state0 = _prepare(
        q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm)
    out = torch.empty(vf.shape, dtype=torch.float32, device=v.device)
    states = torch.empty((q.shape[0], *state0.shape[1:]), dtype=torch.float32, device=v.device)
    bounds = cu_seqlens.tolist()
    for s in range(len(bounds) - 1):
        state = state0[s : s + 1]
        for t in range(bounds[s], bounds[s + 1]):
            tt = slice(t, t + 1)
            o_t, state = _gdn_step(state, qf[tt], kf[tt], vf[tt], gf[tt], bf[tt])
            out[t] = o_t[0]
            states[t] = state[0]
    return out.to(v.dtype), states


def gdn_verify(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor, cu_seqlens: torch.Tensor, *, scale: float | None = None,
    use_qk_l2norm: bool = True, chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched over sequences: step ``p`` updates every sequence with a token at offset ``p``
    (one fused step each) and records the new states at those tokens' rows."""
    del chunk_size
    qf, kf, vf, gf, bf, state0 = _prepare(
        q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm)
    total = q.shape[0]
    device = v.device
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    lengths = (cu[1:] - cu[:-1]).tolist()
    out = torch.empty(vf.shape, dtype=torch.float32, device=device)
    states = torch.empty((total, *state0.shape[1:]), dtype=torch.float32, device=device)
    starts = cu[:-1]
    state = state0
    for p in range(max(lengths, default=0)):
        live = [s for s, n in enumerate(lengths) if n > p]
        sel = torch.tensor(live, dtype=torch.long, device=device)
        idx = starts[sel] + p
        o_t, new = _gdn_step_fused(state[sel], qf[idx], kf[idx], vf[idx], gf[idx], bf[idx])
        out[idx] = o_t
        states[idx] = new
        state = state.index_copy(0, sel, new)
    return out.to(v.dtype), states


# ----------------------------------------------------------------------------- Mamba-2 SSD


def ssd_verify_naive(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None, initial_state: torch.Tensor, cu_seqlens: torch.Tensor, *,
    dt_bias: torch.Tensor | None, dt_softplus: bool = True, dt_min: float = 0.0,
    dt_max: float = math.inf, chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Definition: ``(y (T, H, P), states (T, H, P, N) float32)``."""
    del chunk_size
    T, H, _, _, _ = _check_inputs(x, dt, A, B, C, D, initial_state, cu_seqlens)
    starts, lens = _seq_bounds(cu_seqlens, T)
    dtf = _discretize_dt(dt, dt_bias, dt_softplus, dt_min, dt_max)
    xf, Af = x.float(), A.float()
    Bh, Ch = _heads_view(B.float(), H), _heads_view(C.float(), H)
    y = torch.empty_like(xf)
    states = torch.empty((T, *initial_state.shape[1:]), dtype=torch.float32, device=x.device)
    for s, (start, n) in enumerate(zip(starts, lens, strict=True)):
        h = initial_state[s].float()
        for t in range(start, start + n):
            decay = torch.exp(dtf[t] * Af)
            h = decay[:, None, None] * h + (dtf[t][:, None] * xf[t])[..., None] * Bh[t][:, None, :]
            y[t] = (h * Ch[t][:, None, :]).sum(-1)
            states[t] = h
    if D is not None:
        y = y + D.float()[:, None] * xf
    return y.to(x.dtype), states


def ssd_verify(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None, initial_state: torch.Tensor, cu_seqlens: torch.Tensor, *,
    dt_bias: torch.Tensor | None, dt_softplus: bool = True, dt_min: float = 0.0,
    dt_max: float = math.inf, chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched over sequences, one recurrence step per token offset, states recorded."""
    del chunk_size
    T, H, _, _, _ = _check_inputs(x, dt, A, B, C, D, initial_state, cu_seqlens)
    starts, lens = _seq_bounds(cu_seqlens, T)
    dtf = _discretize_dt(dt, dt_bias, dt_softplus, dt_min, dt_max)
    xf, Af = x.float(), A.float()
    Bh, Ch = _heads_view(B.float(), H), _heads_view(C.float(), H)
    y = torch.empty_like(xf)
    states = torch.empty((T, *initial_state.shape[1:]), dtype=torch.float32, device=x.device)
    state = initial_state.float()
    start_t = torch.tensor(starts, dtype=torch.long, device=x.device)
    for p in range(max(lens, default=0)):
        sel = torch.tensor([s for s, n in enumerate(lens) if n > p], dtype=torch.long,
                           device=x.device)
        idx = start_t[sel] + p
        y_t, new = _ssd_step(state[sel], xf[idx], dtf[idx], Af, Bh[idx], Ch[idx])
        y[idx] = y_t
        states[idx] = new
        state = state.index_copy(0, sel, new)
    if D is not None:
        y = y + D.float()[:, None] * xf
    return y.to(x.dtype), states
