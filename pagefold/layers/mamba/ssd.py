"""Mamba-2 state-space-duality (SSD) scan kernels over flat variable-length batches.

Every kernel here has the same signature and the same contract, so callers can swap them:

    fn(x, dt, A, B, C, D, initial_state, cu_seqlens, *, dt_bias, dt_softplus=True,
       dt_min=0.0, dt_max=inf, chunk_size=64) -> (y, final_state)

Shapes (T = total new tokens of all sequences, S = number of sequences):

* ``x``: (T, H, P) post-conv, post-activation SSM input; any float dtype.
* ``dt``: (T, H) raw time step, *before* ``dt_bias`` and softplus.
* ``A``: (H,) the (negative) continuous decay, ``-exp(A_log)``.
* ``B``, ``C``: (T, G, N) with ``H % G == 0``; head ``h`` reads group ``h // (H // G)``.
* ``D``: (H,) skip weight, or None for no skip term.
* ``initial_state``: (S, H, P, N) float32, the state before each sequence's first new token
  (zeros for a fresh sequence). It is never modified.
* ``cu_seqlens``: (S + 1,) int64, ``cu_seqlens[0] == 0`` and ``cu_seqlens[-1] == T``;
  sequence ``s`` owns tokens ``cu_seqlens[s]:cu_seqlens[s + 1]`` (empty sequences are allowed
  and return their initial state unchanged).

Returns ``y`` (T, H, P) in ``x.dtype`` and ``final_state`` (S, H, P, N) float32.

Math (all in float32, as transformers' torch path for Mamba-2 does):

    dt'  = clamp(softplus(dt + dt_bias), dt_min, dt_max)      (softplus only if dt_softplus)
    h_t  = exp(dt'_t * A) * h_{t-1} + dt'_t * x_t B_t^T        (h: (H, P, N))
    y_t  = h_t C_t + D * x_t

``ssd_naive`` is the definition (token loop); ``ssd_chunked`` is the chunkwise-parallel form
for prefill; ``ssd_recurrent`` is the decode form (fully batched when every sequence has a
single token). Splitting a sequence into pieces and carrying ``final_state`` into the next
piece's ``initial_state`` gives the same result as one pass, up to float32 rounding.

``capture=(after, out)`` (optional, every kernel; :mod:`pagefold.layers.state_capture`):
``out[m]`` (float32, (M, H, P, N)) receives the state right after flat token ``after[m]``;
``ssd_chunked`` also takes a ``PagedOut`` (the checkpoint pages themselves) as ``out``.
``per_token_states=True`` (naive and recurrent; speculative verification): the second result
is the state after *every* token, (T, H, P, N) float32, instead of the final states.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagefold.layers.state_capture import Capture, PagedOut, check_capture, seq_of

__all__ = ["SSD_KERNELS", "SSDKernel", "ssd_chunked", "ssd_naive", "ssd_recurrent"]

SSDKernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _check_inputs(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> tuple[int, int, int, int, int]:
    """Validate shapes; return (T, H, P, G, N)."""
    if x.dim() != 3:
        raise ValueError(f"x must be (T, H, P), got {tuple(x.shape)}")
    T, H, P = x.shape
    if dt.shape != (T, H):
        raise ValueError(f"dt must be {(T, H)}, got {tuple(dt.shape)}")
    if A.shape != (H,):
        raise ValueError(f"A must be {(H,)}, got {tuple(A.shape)}")
    if B.dim() != 3 or B.shape[0] != T or B.shape != C.shape:
        raise ValueError(f"B and C must both be (T, G, N); got {tuple(B.shape)}, {tuple(C.shape)}")
    G, N = B.shape[1], B.shape[2]
    if H % G != 0:
        raise ValueError(f"num heads {H} must be divisible by num groups {G}")
    if D is not None and D.shape != (H,):
        raise ValueError(f"D must be {(H,)}, got {tuple(D.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must be a non-empty 1-D tensor")
    S = cu_seqlens.numel() - 1
    if initial_state.shape != (S, H, P, N):
        raise ValueError(
            f"initial_state must be {(S, H, P, N)}, got {tuple(initial_state.shape)}"
        )
    return T, H, P, G, N


def _seq_bounds(cu_seqlens: torch.Tensor, T: int) -> tuple[list[int], list[int]]:
    """Host-side (starts, lengths) per sequence; validates monotonicity and the total."""
    cu = [int(v) for v in cu_seqlens.tolist()]
    if cu[0] != 0 or cu[-1] != T:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={T}, got {cu[0]}..{cu[-1]}")
    lens = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    if any(n < 0 for n in lens):
        raise ValueError("cu_seqlens must be non-decreasing")
    return cu[:-1], lens


def _discretize_dt(
    dt: torch.Tensor,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_min: float,
    dt_max: float,
) -> torch.Tensor:
    """(T, H) float32 time step: bias, softplus, then clamp to [dt_min, dt_max] (HF order)."""
    out = dt.float()
    if dt_bias is not None:
        out = out + dt_bias.float()
    if dt_softplus:
        out = F.softplus(out)
    if dt_min > 0.0 or dt_max < math.inf:
        out = out.clamp(min=dt_min, max=dt_max)
    return out


def _heads_view(t: torch.Tensor, H: int) -> torch.Tensor:
    """(..., G, N) -> (..., H, N) by broadcasting group g to its H // G consecutive heads."""
    *lead, G, N = t.shape
    return t.unsqueeze(-2).expand(*lead, G, H // G, N).reshape(*lead, H, N)


def _step(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrence step for a batch of M independent sequences, all float32.

    state (M, H, P, N), x (M, H, P), dt (M, H), A (H,), B/C (M, H, N) already per head.
    Returns (y without the D term (M, H, P), new state (M, H, P, N)).
    """
    M, H, P, N = state.shape
    decay = torch.exp(dt * A)  # (M, H)
    new_state = state * decay[:, :, None, None]
    # Rank-1 update dt x B^T per (sequence, head), accumulated in place: one fewer full-size
    # temporary than materialising the outer product (the state dominates decode traffic).
    xdt = (dt[:, :, None] * x).reshape(M * H, P, 1)
    new_state.view(M * H, P, N).baddbmm_(xdt, B.reshape(M * H, 1, N))
    y = torch.matmul(new_state, C.unsqueeze(-1)).squeeze(-1)
    return y, new_state


def ssd_naive(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool = True,
    dt_min: float = 0.0,
    dt_max: float = math.inf,
    chunk_size: int = 64,
    capture: Capture | None = None,
    per_token_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference SSD: the literal per-token recurrence, one sequence and one token at a time.

    Slow by design (it is the definition the other kernels are tested against).
    ``chunk_size`` is accepted for signature compatibility and ignored.
    """
    del chunk_size
    T, H, _, _, _ = _check_inputs(x, dt, A, B, C, D, initial_state, cu_seqlens)
    starts, lens = _seq_bounds(cu_seqlens, T)
    dtf = _discretize_dt(dt, dt_bias, dt_softplus, dt_min, dt_max)
    xf, Af = x.float(), A.float()
    Bh, Ch = _heads_view(B.float(), H), _heads_view(C.float(), H)
    y = torch.empty_like(xf)
    final = initial_state.float().clone()
    cap = check_capture(capture, T, tuple(final.shape[1:]))
    at: dict[int, list[int]] = {}
    for m, a in enumerate(cap[0] if cap else []):
        at.setdefault(a, []).append(m)
    states = (torch.empty((T, *initial_state.shape[1:]), dtype=torch.float32, device=x.device)
              if per_token_states else None)
    for s, (start, n) in enumerate(zip(starts, lens, strict=True)):
        h = final[s]  # (H, P, N)
        for t in range(start, start + n):
            decay = torch.exp(dtf[t] * Af)  # (H,)
            h = decay[:, None, None] * h + (dtf[t][:, None] * xf[t])[..., None] * Bh[t][:, None, :]
            y[t] = (h * Ch[t][:, None, :]).sum(-1)
            for m in at.get(t, ()):
                cap[1][m] = h
            if states is not None:
                states[t] = h
        final[s] = h
    if D is not None:
        y = y + D.float()[:, None] * xf
    return y.to(x.dtype), final if states is None else states


def ssd_recurrent(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool = True,
    dt_min: float = 0.0,
    dt_max: float = math.inf,
    chunk_size: int = 64,
    capture: Capture | None = None,
    per_token_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrent (decode) SSD, batched across sequences.

    When every sequence has exactly one new token (T == S, the decode step) this is a single
    batched state update with no Python loop (one cheap layout check is read back to the host to
    tell that case from e.g. lengths [0, 2], which also has T == S). Otherwise it loops over token
    positions ``t < max(len)``, each step updating all sequences that still have a token at
    offset ``t`` together. ``chunk_size`` is ignored.
    """
    del chunk_size
    T, H, _, _, _ = _check_inputs(x, dt, A, B, C, D, initial_state, cu_seqlens)
    S = cu_seqlens.numel() - 1
    dtf = _discretize_dt(dt, dt_bias, dt_softplus, dt_min, dt_max)
    xf, Af = x.float(), A.float()
    Bh, Ch = _heads_view(B.float(), H), _heads_view(C.float(), H)
    state0 = initial_state.float()
    cap = check_capture(capture, T, tuple(state0.shape[1:]))

    if T == S:
        # T == S does not imply one token each (lengths [0, 2]): only the true single-token
        # layout may take the loop-free path.
        if S == 0 or bool(torch.all(cu_seqlens[1:] - cu_seqlens[:-1] == 1)):
            y, final = _step(state0, xf, dtf, Af, Bh, Ch)
            if cap:  # sequence i is token i: a capture is that sequence's final state
                cap[1].copy_(final[torch.tensor(cap[0], dtype=torch.long, device=x.device)])
            if D is not None:
                y = y + D.float()[:, None] * xf
            return y.to(x.dtype), final

    starts, lens = _seq_bounds(cu_seqlens, T)
    # Longest sequences first, so the sequences still running at offset t are a prefix.
    order = sorted(range(S), key=lambda s: -lens[s])
    order_t = torch.tensor(order, dtype=torch.long, device=x.device)
    sorted_starts = torch.tensor([starts[s] for s in order], dtype=torch.long, device=x.device)
    sorted_lens = [lens[s] for s in order]
    state = state0.index_select(0, order_t).clone() if S > 0 else state0.clone()
    y = torch.empty_like(xf)
    max_len = sorted_lens[0] if S > 0 else 0
    at: dict[int, list[tuple[int, int]]] = {}  # offset -> (capture, rank in sorted order)
    if cap:
        rank = {s: r for r, s in enumerate(order)}
        for m, (s, off) in enumerate(seq_of([*starts, T], cap[0])):
            at.setdefault(off, []).append((m, rank[s]))
    n_active = S
    states = (torch.empty((T, *state0.shape[1:]), dtype=torch.float32, device=x.device)
              if per_token_states else None)
    for t in range(max_len):
        while n_active > 0 and sorted_lens[n_active - 1] <= t:
            n_active -= 1
        tok = sorted_starts[:n_active] + t
        y_t, state[:n_active] = _step(
            state[:n_active], xf[tok], dtf[tok], Af, Bh[tok], Ch[tok]
        )
        y[tok] = y_t
        for m, r in at.get(t, ()):
            cap[1][m] = state[r]
        if states is not None:
            states[tok] = state[:n_active]
    final = torch.empty_like(state)
    if S > 0:
        final[order_t] = state
    if D is not None:
        y = y + D.float()[:, None] * xf
    return y.to(x.dtype), final if states is None else states


# Bytes of one (heads, chunk, max(chunk, head_dim)) float32 table per group of sequences
# that :func:`ssd_chunked` takes through a chunk position together (about a core's L2).
GROUP_BYTES = 2 << 20


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """Stable segment sums: out[..., i, j] = sum(a[..., j+1 : i+1]) for i >= j, else -inf.

    Built by a masked cumulative sum instead of ``cumsum[i] - cumsum[j]``, so long chunks with
    large decays do not lose precision to cancellation. a (..., L) -> (..., L, L).
    """
    L = a.shape[-1]
    lower = torch.ones(L, L, dtype=torch.bool, device=a.device).tril()
    strict = lower.tril(-1)
    # rep[..., i, j] = a[i] where i > j: summing down column j gives a[j+1] + ... + a[i].
    rep = a.unsqueeze(-1).expand(*a.shape, L).masked_fill(~strict, 0.0)
    return torch.cumsum(rep, dim=-2).masked_fill_(~lower, -math.inf)


def _capture_row(out: torch.Tensor, h0: torch.Tensor, xc: torch.Tensor, decay_row: torch.Tensor,
                 acum_row: torch.Tensor, Bc: torch.Tensor, row: int) -> None:
    """The state after row ``row`` of one sequence's chunk, written into ``out`` (H, P, N).

    h0 (H, P, N) the chunk-start state, xc (H, L, P) ``dt x``, decay_row (H, L) =
    ``exp(segsum)[:, row, :]`` (zero past ``row``), acum_row (H,) the log-decay from the
    chunk start through ``row``, Bc (G, L, N). The chunk-end state passing of
    :func:`ssd_chunked` with row ``row`` for ``L - 1``, summed over the ``row + 1`` tokens
    that contribute (the rest have zero weight).
    """
    H, _, P = xc.shape
    G, N = Bc.shape[0], Bc.shape[-1]
    n = row + 1
    w = (xc[:, :n] * decay_row[:, :n].unsqueeze(-1)).transpose(-1, -2)  # (H, P, n)
    upd = torch.matmul(w.reshape(G, (H // G) * P, n), Bc[:, :n]).view(H, P, N)
    out.copy_(h0 * torch.exp(acum_row)[:, None, None] + upd)


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool = True,
    dt_min: float = 0.0,
    dt_max: float = math.inf,
    chunk_size: int = 64,
    capture: Capture | None = None,
    compiled: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise-parallel SSD (Mamba-2's "state space duality" form) over a varlen batch.

    Each sequence is cut into chunks of ``L = min(chunk_size, longest sequence)`` tokens (the
    last one may be short). The loop runs over chunk *positions* (0, 1, ...), and at each
    position processes the corresponding chunk of every sequence still running, all heads at
    once with batched matmuls:

    * intra-chunk: ``Y_diag = (C B^T * exp(segsum(dt A))) (dt x)`` -- the quadratic form;
    * from the carried state: ``Y_off = exp(cumsum(dt A)) * (C h_start)``;
    * state passing: ``h_end = exp(sum(dt A)) h_start + sum_l exp(tail decay_l) dt_l x_l B_l^T``.

    Short chunks are padded with dt = 0, x = B = C = 0 tokens, which decay by exp(0) = 1 and add
    nothing, so padding never changes a state. Memory is O(S H P N + active chunks * H L^2);
    the per-chunk states are not all materialised at once.

    Captures never change the chunking (so ``y`` and the final states are bitwise those of the
    call without them). A capture at the last real token of a chunk is the chunk-end state
    (bitwise a call cut there, when both chunk alike: same ``L``); one at row ``l`` inside a
    chunk is computed directly from the chunk-start state,
    ``exp(acum_l) h_start + sum_{s <= l} exp(segsum[l, s]) dt_s x_s B_s^T`` -- row ``l`` of
    the decay matrix the state passing uses with row ``L - 1`` (equal to a cut call up to
    float32 rounding).

    ``compiled`` (default): on the CPU with the kernels on, the compiled form of these steps
    (``csrc/ssd.cpp``) runs instead; it agrees with this torch form up to float32 rounding
    (other summation orders). ``compiled=False`` or kernels off: the torch form.
    """
    T, H, P, G, N = _check_inputs(x, dt, A, B, C, D, initial_state, cu_seqlens)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    S = cu_seqlens.numel() - 1
    starts, lens = _seq_bounds(cu_seqlens, T)
    dev = x.device
    Hg = H // G

    dtf = _discretize_dt(dt, dt_bias, dt_softplus, dt_min, dt_max)
    max_len = max(lens, default=0)
    if max_len == 0:
        return x.new_zeros((T, H, P)), initial_state.float().clone()
    L = min(chunk_size, max_len)
    cap = check_capture(capture, T, (H, P, N), paged=True)
    paged = cap[1] if cap is not None and isinstance(cap[1], PagedOut) else None
    if paged is not None and paged.dtype != torch.float32:
        # The compiled scan stores float32 states only: a state pool in another dtype
        # (mamba_ssm_dtype bf16) takes its captures through a buffer, cast when written.
        cap = (cap[0], paged.buffer())
    if compiled:  # the compiled scan (csrc/ssd.cpp): same chunking, same steps
        from pagefold.layers.mamba.ssd_cpu import ssd_chunked_cpu

        res = ssd_chunked_cpu(x, dtf, A, B, C, D, initial_state, [*starts, T], L, cap)
        if res is not None:
            if paged is not None and cap[1] is not paged:
                paged.write(cap[1])
            return res
    if paged is not None and cap[1] is paged:  # the torch form fills a buffer, stored at the end
        cap = (cap[0], paged.buffer())
    Af = A.float()
    # Row T of every padded table is all zeros: the target of padding indices. (Filled in
    # place: these tables are tens of MB at prefill sizes, each extra pass costs.)
    xdt = x.new_empty((T + 1, H, P), dtype=torch.float32)
    xdt[T] = 0.0
    torch.mul(x, dtf[:, :, None], out=xdt[:T])
    adt = dtf.new_zeros((T + 1, H))
    adt[:T] = dtf * Af
    Bp = x.new_zeros((T + 1, G, N), dtype=torch.float32)
    Bp[:T] = B
    Cp = x.new_zeros((T + 1, G, N), dtype=torch.float32)
    Cp[:T] = C

    # Every real row is written by the loop below (row T takes the padding rows' writes).
    out = x.new_empty((T + 1, H, P), dtype=torch.float32)
    n_chunks = [-(-n // L) for n in lens]
    # Sequences with the most chunks first: the ones still running at a chunk position are a
    # prefix, so the carried state is sliced, never scattered.
    order = sorted(range(S), key=lambda s: -n_chunks[s])
    order_t = torch.tensor(order, dtype=torch.long, device=dev)
    state = initial_state.float().index_select(0, order_t).clone()
    s_starts = torch.tensor([starts[s] for s in order], dtype=torch.long, device=dev)
    s_lens = torch.tensor([lens[s] for s in order], dtype=torch.long, device=dev)
    s_chunks = [n_chunks[s] for s in order]
    offs = torch.arange(L, dtype=torch.long, device=dev)
    # Chunk position -> (capture, rank, row in the chunk); ``at_end``: captures whose token is
    # the last of its chunk's real ones, which are the chunk-end state itself (copied after the
    # state passing; the interval targets are multiples of the block size, mostly of L).
    at: dict[int, list[tuple[int, int, int]]] = {}
    at_end: dict[int, list[tuple[int, int]]] = {}
    if cap:
        rank = {s: r for r, s in enumerate(order)}
        for m, (s, off) in enumerate(seq_of([*starts, T], cap[0])):
            if off % L == L - 1 or off == lens[s] - 1:
                at_end.setdefault(off // L, []).append((m, rank[s]))
            else:
                at.setdefault(off // L, []).append((m, rank[s], off % L))

    # Sequences go through a chunk position in groups whose (H, L, L) and (H, L, P) float32
    # tables stay around 2 MB: a dozen passes over them then hit the cache, not memory
    # (a 16 x 256-token Mamba-2 prefill, 32 heads of 64: ~0.75x the time of all at once).
    group = max(1, GROUP_BYTES // (H * L * max(L, P) * 4))
    n_active = S
    for j in range(s_chunks[0]):
        while s_chunks[n_active - 1] <= j:
            n_active -= 1
        pos = j * L + offs  # (L,) offsets of this chunk within each sequence
        for m0 in range(0, n_active, group):
            m1 = min(n_active, m0 + group)
            M = m1 - m0
            idx = s_starts[m0:m1, None] + pos[None, :]  # (M, L)
            idx = torch.where(pos[None, :] < s_lens[m0:m1, None], idx, T)

            xc = xdt[idx].permute(0, 2, 1, 3)  # (M, H, L, P)
            ac = adt[idx].transpose(1, 2)  # (M, H, L)
            Bc = Bp[idx].transpose(1, 2)  # (M, G, L, N)
            Cc = Cp[idx].transpose(1, 2)  # (M, G, L, N)

            decay = _segsum(ac).exp_()  # (M, H, L, L): exp(log-decay from token s to l)
            acum = torch.cumsum(ac, dim=-1)  # (M, H, L): log-decay from chunk start to l

            # Intra-chunk (diagonal block): scores C_l . B_s are shared by a group's heads.
            cb = torch.matmul(Cc, Bc.transpose(-1, -2))  # (M, G, L, L)
            scores = (cb.unsqueeze(2) * decay.view(M, G, Hg, L, L)).view(M, H, L, L)
            y = torch.matmul(scores, xc)  # (M, H, L, P)

            # Contribution of the carried state: heads of a group are stacked along the rows
            # of one (Hg*P, N) matrix so C multiplies them all in one matmul.
            st = state[m0:m1].view(M, G, Hg * P, N)
            y_off = torch.matmul(Cc, st.transpose(-1, -2))  # (M, G, L, Hg*P)
            y_off = y_off.view(M, G, L, Hg, P).permute(0, 1, 3, 2, 4).reshape(M, H, L, P)
            y.add_(y_off.mul_(torch.exp(acum).unsqueeze(-1)))

            # State passing: decay[..., L-1, s] is the stable log-decay from s to chunk end.
            w = (xc * decay[..., L - 1, :].unsqueeze(-1)).transpose(-1, -2)  # (M, H, P, L)
            upd = torch.matmul(w.reshape(M, G, Hg * P, L), Bc).view(M, H, P, N)
            for m, r, row in at.get(j, ()):  # from the chunk-start state, before it moves on
                if m0 <= r < m1:
                    k = r - m0
                    _capture_row(cap[1][m], state[r], xc[k], decay[k, :, row],
                                 acum[k, :, row], Bc[k], row)
            chunk_decay = torch.exp(acum[..., -1])  # (M, H)
            state[m0:m1].mul_(chunk_decay[:, :, None, None]).add_(upd)
            for m, r in at_end.get(j, ()):
                if m0 <= r < m1:
                    cap[1][m] = state[r]

            out[idx] = y.permute(0, 2, 1, 3)  # (M, L, H, P) rows scattered without a copy

    yf = out[:T]
    if D is not None:
        yf.add_(x * D.float()[:, None])
    final = torch.empty_like(state)
    final[order_t] = state
    if paged is not None:
        paged.write(cap[1])
    return yf.to(x.dtype), final


SSD_KERNELS: dict[str, SSDKernel] = {
    "naive": ssd_naive,
    "chunked": ssd_chunked,
    "recurrent": ssd_recurrent,
}
