"""Depthwise causal 1-D convolution over flat variable-length batches.

This is the short convolution that Gated DeltaNet (and Mamba-2) layers apply to their fused
q/k/v projections before the recurrent mixer. For channel ``c`` and kernel size ``K``::

    y[t, c] = act(bias[c] + sum_{j=0}^{K-1} weight[c, j] * x[t - (K-1) + j, c])

where positions before the start of the new tokens are read from the sequence's conv state
(``weight[:, K-1]`` multiplies the current token). This is exactly what transformers computes
with ``F.conv1d(x, weight.unsqueeze(1), padding=K-1, groups=C)[..., :L]`` for a fresh sequence.

Layout conventions shared by every function here:

* ``x`` is ``(T, C)``: the new tokens of all ``N`` sequences concatenated along dim 0, with
  ``cu_seqlens`` (int64, ``(N+1,)``, ``cu_seqlens[0] == 0``, non-decreasing) marking sequence
  boundaries. Zero-length sequences are allowed; their state passes through unchanged.
* ``weight`` is ``(C, K)`` (the squeezed ``nn.Conv1d`` weight), ``bias`` is ``(C,)`` or None.
* ``conv_state`` is ``(N, C, K-1)``: the previous ``K-1`` inputs of each sequence, oldest first
  (zeros for a fresh sequence). The returned state has the same layout and holds the last
  ``K-1`` inputs *including* history, so it is correct when a sequence has fewer than ``K-1``
  new tokens.
* The arithmetic runs in float32; ``y`` is returned in ``x``'s dtype and the new state in
  ``x``'s dtype. Inputs are never modified in place.
* ``per_token_states=True`` (speculative verification, ``spec_decode``): the second result is
  the state after *every* token, ``(T, C, K-1)`` (row ``t``: the state right after token
  ``t``), instead of each sequence's final state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagefold.ops.common.capture import Capture, PagedOut, check_capture, per_token, seq_of
from pagefold.ops.conv1d import cpu as conv_cpu  # looked up per call: tests count the calls

__all__ = ["causal_conv1d_naive", "causal_conv1d_state_at", "causal_conv1d_update",
           "causal_conv1d_varlen", "causal_conv1d_verify", "causal_conv1d_verify_naive"]

_ACTIVATIONS = (None, "silu", "swish")


def check_args(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
               activation: str | None) -> tuple[int, int]:
    """Validate shapes shared by all variants; return ``(C, K)``."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {activation!r}; expected one of {_ACTIVATIONS}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be (C, K), got {tuple(weight.shape)}")
    channels, kernel = weight.shape
    if kernel < 2:
        raise ValueError(f"kernel size must be >= 2, got {kernel}")
    if x.dim() != 2 or x.shape[1] != channels:
        raise ValueError(f"x must be (T, {channels}), got {tuple(x.shape)}")
    if conv_state.dim() != 3 or conv_state.shape[1:] != (channels, kernel - 1):
        raise ValueError(
            f"conv_state must be (N, {channels}, {kernel - 1}), got {tuple(conv_state.shape)}"
        )
    return channels, kernel


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return y if activation is None else F.silu(y)


def causal_conv1d_naive(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        conv_state: torch.Tensor, cu_seqlens: torch.Tensor,
                        activation: str | None = "silu", *, per_token_states: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference implementation: explicit loop over sequences and tokens.

    Shapes: x (T, C), weight (C, K), bias (C,) | None, conv_state (N, C, K-1),
    cu_seqlens (N+1,). Returns ``(y (T, C), new_conv_state (N, C, K-1))``.
    Meant for testing; it is slow by design.
    """
    channels, kernel = check_args(x, weight, conv_state, activation)
    w = weight.float()
    b = bias.float() if bias is not None else None
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    new_state = torch.empty(conv_state.shape, dtype=x.dtype, device=x.device)
    states = (torch.empty((x.shape[0], *conv_state.shape[1:]), dtype=x.dtype, device=x.device)
              if per_token_states else None)
    bounds = cu_seqlens.tolist()
    for s in range(len(bounds) - 1):
        start, end = bounds[s], bounds[s + 1]
        # window holds the K-1 most recent inputs (oldest first) plus the current one.
        history = conv_state[s].float()  # (C, K-1)
        for t in range(start, end):
            window = torch.cat([history, x[t].float().unsqueeze(1)], dim=1)  # (C, K)
            out = (window * w).sum(dim=1)
            if b is not None:
                out = out + b
            y[t] = _activate(out, activation)
            history = window[:, 1:]
            if states is not None:
                states[t] = history.to(x.dtype)
        new_state[s] = history.to(x.dtype)
    return y.to(x.dtype), new_state if states is None else states


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_state: torch.Tensor, cu_seqlens: torch.Tensor,
                         activation: str | None = "silu", *, per_token_states: bool = False,
                         compiled: bool = True, capture: Capture | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectorized varlen causal conv: one pass over all sequences.

    ``compiled`` (default): on the CPU with the kernels on, the compiled conv
    (``csrc/conv.cpp``: the same products and order, fused multiply-adds, so equal up to
    float32 rounding) runs instead of the torch form below (not for ``per_token_states``).

    ``capture=(after, out)`` (:mod:`pagefold.ops.common.capture`): ``out[m]`` receives the
    state right after flat token ``after[m]`` (:func:`causal_conv1d_state_at`'s); ``out`` a
    buffer or a ``PagedOut``, which the compiled conv writes straight into the pages.

    Shapes as in :func:`causal_conv1d_naive`. Each sequence's state is placed in front of its
    tokens in one extended buffer of length ``T + N*(K-1)``; a single unpadded depthwise conv
    over that buffer yields every token's output at a known offset (windows that straddle two
    sequences are computed and discarded, ``N*(K-1)`` of them). The new state of each sequence
    is the last ``K-1`` columns of its extended segment, which may include old state columns.
    """
    channels, kernel = check_args(x, weight, conv_state, activation)
    hist = kernel - 1
    num_seqs = cu_seqlens.numel() - 1
    if conv_state.shape[0] != num_seqs:
        raise ValueError(f"conv_state has {conv_state.shape[0]} rows for {num_seqs} sequences")
    cap = check_capture(capture, x.shape[0], (channels, hist), paged=True)
    if cap is not None and per_token_states:
        raise ValueError("capture and per_token_states do not go together")
    res, written = None, False
    if compiled and not per_token_states:
        paged = cap if cap is not None and isinstance(cap[1], PagedOut) else None
        res = conv_cpu.conv_varlen_cpu(x, weight, bias, conv_state, cu_seqlens, activation, paged)
        written = res is not None and paged is not None
    if cap is not None and not written:  # the windows of the inputs
        states = causal_conv1d_state_at(x, conv_state, cu_seqlens, capture[0])
        if isinstance(cap[1], PagedOut):
            cap[1].write(states)
        else:
            cap[1].copy_(states)
    if res is not None:
        return res
    device = x.device
    total = x.shape[0]
    cu = cu_seqlens.to(device=device, dtype=torch.long)

    tok = torch.arange(total, device=device)
    # seg[t] = index of the sequence owning token t (sync-free, unlike repeat_interleave).
    seg = torch.searchsorted(cu[1:], tok, right=True)
    seq_ids = torch.arange(num_seqs, device=device)
    # Extended segment of sequence s starts at cu[s] + s*(K-1): K-1 state columns, then tokens.
    ext_start = cu[:-1] + seq_ids * hist  # (N,)
    tok_pos = tok + seg * hist + hist  # (T,)
    state_pos = (ext_start.unsqueeze(1) + torch.arange(hist, device=device)).reshape(-1)
    ext_len = total + num_seqs * hist

    # Token-major (rows = positions): the scatters below move whole rows, and the conv is K
    # shifted multiply-adds over contiguous rows. (A depthwise F.conv1d over a channel-major
    # copy took ~10x as long on CPU: oneDNN's 1-D depthwise path plus column scatters.)
    ext = torch.empty(ext_len, channels, dtype=torch.float32, device=device)
    ext[tok_pos] = x.float()
    ext[state_pos] = conv_state.float().transpose(1, 2).reshape(-1, channels)
    w = weight.float()
    n_out = ext_len - hist  # row i is the window ext[i : i + K]
    out = ext[:n_out] * w[:, 0]
    for j in range(1, kernel):
        out.addcmul_(ext[j : j + n_out], w[:, j])
    if bias is not None:
        out += bias.float()
    # Token t's window ends at its own extended position, so it starts K-1 rows earlier.
    y = _activate(out[tok_pos - hist], activation)
    if per_token_states:  # the K-1 rows ending at each token's own row
        rows = tok_pos.unsqueeze(1) - hist + 1 + torch.arange(hist, device=device)  # (T, K-1)
        states = ext[rows.reshape(-1)].view(total, hist, channels).transpose(1, 2)
        return y.to(x.dtype), states.to(x.dtype).contiguous()

    # Last K-1 rows of each extended segment; its end is cu[s+1] + (s+1)*(K-1).
    ext_end = cu[1:] + (seq_ids + 1) * hist
    last_pos = ext_end.unsqueeze(1) - hist + torch.arange(hist, device=device)  # (N, K-1)
    new_state = ext[last_pos.reshape(-1)].view(num_seqs, hist, channels).transpose(1, 2)
    return y.to(x.dtype), new_state.to(x.dtype).contiguous()


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_state: torch.Tensor, activation: str | None = "silu"
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode fast path: exactly one new token per sequence, fully batched.

    Shapes: x (N, C), weight (C, K), bias (C,) | None, conv_state (N, C, K-1).
    Returns ``(y (N, C), new_conv_state (N, C, K-1))``; equivalent to
    :func:`causal_conv1d_varlen` with ``cu_seqlens = arange(N+1)``.
    """
    check_args(x, weight, conv_state, activation)
    if conv_state.shape[0] != x.shape[0]:
        raise ValueError(f"conv_state has {conv_state.shape[0]} rows for {x.shape[0]} tokens")
    window = torch.cat([conv_state.float(), x.float().unsqueeze(2)], dim=2)  # (N, C, K)
    out = (window * weight.float()).sum(dim=2)
    if bias is not None:
        out = out + bias.float()
    y = _activate(out, activation)
    return y.to(x.dtype), window[:, :, 1:].to(x.dtype).contiguous()


def causal_conv1d_state_at(x: torch.Tensor, conv_state: torch.Tensor, cu_seqlens: torch.Tensor,
                           after: torch.Tensor) -> torch.Tensor:
    """The conv state right after flat token ``after[m]`` (a prefix-cache checkpoint taken
    inside a chunk): its sequence's last ``K-1`` inputs up to and including that token, the
    old state in front. x (T, C) the conv *input*, conv_state (N, C, K-1), after (M,).
    Returns (M, C, K-1) in conv_state's dtype, equal to the state a
    :func:`causal_conv1d_varlen` call ending after that token returns."""
    hist = conv_state.shape[2]
    cu = cu_seqlens.tolist()
    after_l = [int(a) for a in after.tolist()]
    out = conv_state.new_empty((len(after_l), conv_state.shape[1], hist))
    # Captures with a full window of new tokens (the usual case: targets lie blocks into the
    # chunk) are one gather of their last ``hist`` inputs; the rest mix in the old state.
    full = []
    for m, (s, off) in enumerate(seq_of(cu, after_l)):
        if off + 1 >= hist:
            full.append(m)
            continue
        window = torch.cat([conv_state[s].t(), x[cu[s] : cu[s] + off + 1].to(conv_state.dtype)])
        out[m] = window[-hist:].t()
    if full and hist > 0:
        rows = torch.tensor([[after_l[m] - hist + 1 + i for i in range(hist)] for m in full],
                            dtype=torch.long, device=x.device)
        win = x[rows].to(conv_state.dtype).transpose(1, 2)  # (F, C, hist)
        if len(full) == len(after_l):
            out.copy_(win)
        else:
            out[torch.tensor(full, dtype=torch.long, device=x.device)] = win
    return out


# The verify forms (speculative decoding): the state after every token.
causal_conv1d_verify_naive = per_token(causal_conv1d_naive)
causal_conv1d_verify = per_token(causal_conv1d_varlen)
