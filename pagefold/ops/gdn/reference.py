"""Gated DeltaNet (gated delta rule) kernels over flat variable-length batches.

Per head, with state ``S`` of shape ``(Dk, Dv)`` and, for each token ``t`` in order::

    S   <- exp(g_t) * S                           # gated decay
    d_t  = beta_t * (v_t - S^T k_t)               # delta-rule correction
    S   <- S + k_t d_t^T                          # write
    o_t  = S^T q_t                                # read (q already scaled)

with ``q``/``k`` optionally L2-normalized (eps 1e-6, as in transformers/FLA) and ``q`` scaled
by ``scale`` (default ``Dk ** -0.5``) after normalization. This matches transformers'
``torch_recurrent_gated_delta_rule`` / ``torch_chunk_gated_delta_rule`` (Qwen3-Next, Qwen3.5).

All three kernels share one signature::

    fn(q, k, v, g, beta, initial_state, cu_seqlens, *, scale=None, use_qk_l2norm=True,
       chunk_size=64) -> (o, final_state)

* ``q``, ``k``: ``(T, H, Dk)``; ``v``: ``(T, H, Dv)``. Heads are already expanded to the value
  head count (grouped k/q heads repeated with ``repeat_interleave`` by the caller).
* ``g``: ``(T, H)`` log-decay (``<= 0``); ``beta``: ``(T, H)`` write strength (post-sigmoid).
* ``cu_seqlens``: int64 ``(N+1,)``, ``cu_seqlens[0] == 0``, non-decreasing; sequence ``s`` owns
  tokens ``cu_seqlens[s]:cu_seqlens[s+1]``. Zero-length sequences are allowed (state passes
  through unchanged).
* ``initial_state``: ``(N, H, Dk, Dv)``, the state after each sequence's earlier tokens (zeros
  for a fresh sequence). Not modified in place.
* Returns ``o`` ``(T, H, Dv)`` in ``v``'s dtype and ``final_state`` ``(N, H, Dk, Dv)`` float32.
  All arithmetic is float32, so feeding ``final_state`` into a later call over the next tokens
  equals one pass over the concatenation up to float32 rounding.
* ``capture=(after, out)`` (optional; :mod:`pagefold.ops.common.capture`): ``out[m]``
  (float32, ``(M, H, Dk, Dv)``) receives the state right after flat token ``after[m]``, as a
  call ending there would return it (prefix-cache checkpoints without cutting the chunk).
* ``per_token_states=True`` (naive and recurrent; speculative verification): the second
  result is the state after *every* token, ``(T, H, Dk, Dv)`` float32, instead of the final
  states, so committing an accepted prefix is a select (``spec_decode``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagefold.ops.common.capture import Capture, capture_plan, check_capture, per_token

__all__ = ["GDN_KERNELS", "gdn_chunked", "gdn_naive", "gdn_recurrent", "gdn_verify",
           "gdn_verify_naive", "l2norm", "torch_chunk_size"]


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` along ``dim`` (the FLA / transformers convention)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            initial_state: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None,
            use_qk_l2norm: bool) -> tuple[torch.Tensor, ...]:
    """Validate shapes, upcast to float32, normalize and scale ``q``/``k``."""
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be (T, H, Dk), got {tuple(q.shape)}, {tuple(k.shape)}")
    total, heads, dk = q.shape
    if v.dim() != 3 or v.shape[:2] != (total, heads):
        raise ValueError(f"v must be ({total}, {heads}, Dv), got {tuple(v.shape)}")
    if g.shape != (total, heads) or beta.shape != (total, heads):
        raise ValueError(f"g and beta must be ({total}, {heads}), got {g.shape}, {beta.shape}")
    num_seqs = cu_seqlens.numel() - 1
    expected = (num_seqs, heads, dk, v.shape[2])
    if tuple(initial_state.shape) != expected:
        raise ValueError(f"initial_state must be {expected}, got {tuple(initial_state.shape)}")
    qf, kf = q.float(), k.float()
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    qf = qf * (dk**-0.5 if scale is None else scale)
    return qf, kf, v.float(), g.float(), beta.float(), initial_state.float()


def _step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
          beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for a batch of rows, written literally as the definition.

    state (B, H, Dk, Dv); q, k (B, H, Dk); v (B, H, Dv); g, beta (B, H).
    Returns ``(o (B, H, Dv), new_state)``; float32 in, float32 out.
    """
    state = state * g.exp()[..., None, None]
    kv_mem = (k.unsqueeze(-2) @ state).squeeze(-2)  # (B, H, Dv) = S^T k
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (q.unsqueeze(-2) @ state).squeeze(-2)
    return out, state


def _step_fused(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                g: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`_step`, arranged to touch the (large) state fewer times.

    With ``a = exp(g)`` and ``S_new = a S + k d^T``, both reads can use the *old* state:
    ``kv_mem = a (S^T k)`` and ``o = S_new^T q = a (S^T q) + (q . k) d``. They share one
    batched matmul, and the write is a decay plus an in-place rank-1 update.
    """
    b, h, dk, dv = state.shape
    decay = g.exp().unsqueeze(-1)  # (B, H, 1)
    reads = torch.stack([k, q], dim=-2) @ state  # (B, H, 2, Dv): S^T k, S^T q
    delta = (v - decay * reads[..., 0, :]) * beta.unsqueeze(-1)
    out = decay * reads[..., 1, :] + (q * k).sum(-1, keepdim=True) * delta
    new = (state * decay.unsqueeze(-1)).reshape(b * h, dk, dv)
    new.baddbmm_(k.reshape(b * h, dk, 1), delta.reshape(b * h, 1, dv))
    return out, new.reshape(b, h, dk, dv)


def _active_counts(sorted_desc: list[int]) -> list[int]:
    """For lengths sorted descending, ``out[p]`` = how many exceed ``p`` (``p < max``)."""
    if not sorted_desc:
        return []
    ends = [0] * (sorted_desc[0] + 1)  # ends[n] = number of sequences of length n
    for n in sorted_desc:
        ends[n] += 1
    out, alive = [], len(sorted_desc) - ends[0]
    for p in range(sorted_desc[0]):
        out.append(alive)
        alive -= ends[p + 1]
    return out


def gdn_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, initial_state: torch.Tensor, cu_seqlens: torch.Tensor, *,
              scale: float | None = None, use_qk_l2norm: bool = True, chunk_size: int = 64,
              capture: Capture | None = None, per_token_states: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Definition of the gated delta rule: loop over sequences, then over tokens.

    Slow; the reference the other kernels are tested against. ``chunk_size`` is ignored.
    """
    del chunk_size  # part of the shared signature only
    qf, kf, vf, gf, bf, state0 = prepare(
        q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm
    )
    cap = check_capture(capture, q.shape[0], tuple(state0.shape[1:]))
    at: dict[int, list[int]] = {}
    for m, a in enumerate(cap[0] if cap else []):
        at.setdefault(a, []).append(m)
    out = torch.empty(vf.shape, dtype=torch.float32, device=v.device)
    final = torch.empty_like(state0)
    states = (torch.empty((q.shape[0], *state0.shape[1:]), dtype=torch.float32,
                          device=v.device) if per_token_states else None)
    bounds = cu_seqlens.tolist()
    for s in range(len(bounds) - 1):
        state = state0[s : s + 1]
        for t in range(bounds[s], bounds[s + 1]):
            tt = slice(t, t + 1)
            o_t, state = _step(state, qf[tt], kf[tt], vf[tt], gf[tt], bf[tt])
            out[t] = o_t[0]
            for m in at.get(t, ()):
                cap[1][m] = state[0]
            if states is not None:
                states[t] = state[0]
        final[s] = state[0]
    return out.to(v.dtype), final if states is None else states


def gdn_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, initial_state: torch.Tensor, cu_seqlens: torch.Tensor, *,
                  scale: float | None = None, use_qk_l2norm: bool = True, chunk_size: int = 64,
                  capture: Capture | None = None, per_token_states: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-recurrent kernel, batched across sequences; the decode path.

    When every sequence has exactly one token (``T == N``) this is a single batched step with no
    index bookkeeping. Otherwise it loops over step ``p = 0 .. max_len-1``; sequences are sorted
    by length (descending) so the ones still running at step ``p`` form a prefix of the state
    batch, and each step is one batched update over them. ``chunk_size`` is ignored.
    """
    del chunk_size  # part of the shared signature only
    qf, kf, vf, gf, bf, state0 = prepare(
        q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm
    )
    total, num_seqs = q.shape[0], cu_seqlens.numel() - 1
    device = v.device
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]
    cap = check_capture(capture, total, tuple(state0.shape[1:]))

    if total == num_seqs and bool((lengths == 1).all()):
        out, final = _step_fused(state0, qf, kf, vf, gf, bf)
        if cap:  # sequence i is token i: a capture is that sequence's final state
            cap[1].copy_(final[torch.tensor(cap[0], dtype=torch.long, device=device)])
        return out.to(v.dtype), final

    out = torch.zeros(vf.shape, dtype=torch.float32, device=device)
    order = torch.argsort(lengths, descending=True, stable=True)
    sorted_lengths = lengths[order].tolist()
    starts = cu[:-1][order]
    state = state0[order]
    # offset -> (capture, rank in sorted order)
    at = capture_plan(cu.tolist(), cap[0], order.tolist())[1] if cap else {}
    states = (torch.empty((total, *state0.shape[1:]), dtype=torch.float32, device=device)
              if per_token_states else None)
    for p, n_act in enumerate(_active_counts(sorted_lengths)):
        idx = starts[:n_act] + p
        o_t, new = _step_fused(state[:n_act], qf[idx], kf[idx], vf[idx], gf[idx], bf[idx])
        state = torch.cat([new, state[n_act:]], dim=0) if n_act < num_seqs else new
        out[idx] = o_t
        for m, r in at.get(p, ()):
            cap[1][m] = state[r]
        if states is not None:
            states[idx] = new
    if states is not None:
        return out.to(v.dtype), states
    final = torch.empty_like(state)
    final[order] = state
    return out.to(v.dtype), final


def _chunk_layout(cu: torch.Tensor, total: int, chunk_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int], int]:
    """Place every token in a padded buffer of chunks laid out step-major.

    Sequences are sorted by chunk count (descending) so that at scan step ``j`` the sequences
    that still have a ``j``-th chunk are a prefix of the sorted order; chunks are stored
    ``[step 0: those sequences][step 1: ...]...``, so each scan step reads one contiguous slice.

    Returns ``(flat_index (T,), order (N,), step_offsets, step_counts, num_chunks)`` where
    ``flat_index[t]`` is token ``t``'s row in the ``(num_chunks * chunk_size)`` padded buffer.
    """
    device = cu.device
    num_seqs = cu.numel() - 1
    lengths = cu[1:] - cu[:-1]
    n_chunks = (lengths + chunk_size - 1) // chunk_size
    order = torch.argsort(n_chunks, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(num_seqs, device=device)

    step_counts = _active_counts(n_chunks[order].tolist())
    max_chunks = len(step_counts)
    step_offsets = [0] * max_chunks
    for j in range(1, max_chunks):
        step_offsets[j] = step_offsets[j - 1] + step_counts[j - 1]
    num_chunks = sum(step_counts)

    tok = torch.arange(total, device=device)
    seg = torch.searchsorted(cu[1:], tok, right=True)
    pos = tok - cu[seg]
    offsets_t = torch.tensor(step_offsets, dtype=torch.long, device=device)
    chunk_id = offsets_t[pos // chunk_size] + rank[seg]
    flat_index = chunk_id * chunk_size + pos % chunk_size
    return flat_index, order, step_offsets, step_counts, num_chunks


def gdn_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, initial_state: torch.Tensor, cu_seqlens: torch.Tensor, *,
                scale: float | None = None, use_qk_l2norm: bool = True, chunk_size: int = 64,
                capture: Capture | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise-parallel kernel (WY / UT-transform form); the prefill path.

    Each sequence is cut into chunks of ``chunk_size`` tokens, the last one zero-padded (padded
    tokens have ``k = v = q = 0``, ``beta = 0``, ``g = 0``, so they neither write nor decay).
    Within a chunk with entry state ``S0``, cumulative log-decay ``G_i = sum_{m<=i} g_m`` and
    ``D_ij = exp(G_i - G_j)`` for ``j <= i``, unrolling the recurrence gives

        corrections  Delta = U - W S0,  U = (I + A)^-1 diag(beta) V,
                                        W = (I + A)^-1 diag(beta * exp(G)) K,
        A_ij = beta_i (k_i . k_j) D_ij for j < i (strictly lower), and
        outputs      O   = diag(exp(G)) Q S0 + ((Q K^T) * D) Delta   (j <= i),
        exit state   S_C = exp(G_C) S0 + (K * exp(G_C - G))^T Delta.

    Everything except the ``Delta``/``O``/``S_C`` lines is computed for all chunks of all
    sequences at once; the scan over chunk steps then runs batched across sequences
    (``max_chunks`` Python iterations, none over tokens). Captures never change the chunking
    (outputs and final states are bitwise those of the call without them): one at the last
    real token of a chunk is that chunk's exit state; one after row ``l`` inside a chunk is
    the exit-state line with the chunk cut there, ``exp(G_l) S0 + (K_{<=l} *
    exp(G_l - G))^T Delta_{<=l}``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    qf, kf, vf, gf, bf, state0 = prepare(
        q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm
    )
    total, heads, dk = qf.shape
    dv = vf.shape[2]
    device = v.device
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    cap = check_capture(capture, total, tuple(state0.shape[1:]))
    flat, order, step_offsets, step_counts, num_chunks = _chunk_layout(cu, total, chunk_size)
    c = chunk_size
    # Scan step -> captures: ``at_end`` (capture, rank) at the last real token of their chunk
    # (the chunk's exit state, copied); ``at`` (capture, rank, row) inside a chunk (computed
    # from the chunk's entry state, see below).
    at, at_end = capture_plan(cu.tolist(), cap[0], order.tolist(), c) if cap else ({}, {})

    def to_chunks(x: torch.Tensor) -> torch.Tensor:
        # (T, H, ...) -> zero-padded (M, H, C, ...) in the step-major chunk layout.
        buf = x.new_zeros((num_chunks * c,) + tuple(x.shape[1:]))
        buf[flat] = x
        buf = buf.reshape((num_chunks, c) + tuple(x.shape[1:]))
        return buf.transpose(1, 2).contiguous()

    qc, kc, vc, gc, bc = (to_chunks(x) for x in (qf, kf, vf, gf, bf))
    cum = gc.cumsum(dim=-1)  # (M, H, C): G_i
    causal = torch.ones(c, c, dtype=torch.bool, device=device).tril()
    # Mask before exp: G_i - G_j > 0 above the diagonal could overflow.
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    k_beta = kc * bc.unsqueeze(-1)
    kt = kc.transpose(-1, -2)
    # Unit lower-triangular system (I + A); the solver reads only the strict lower triangle.
    # Inverting it once (C right-hand sides) and then multiplying is cheaper on CPU than
    # solving for the Dv + Dk columns of U and W directly.
    system = (k_beta @ kt) * decay
    eye = torch.eye(c, dtype=torch.float32, device=device).expand_as(system)
    inv = torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True)
    cum_exp = cum.exp().unsqueeze(-1)
    u = inv @ (vc * bc.unsqueeze(-1))
    w = inv @ (k_beta * cum_exp)
    attn = (qc @ kt) * decay  # (M, H, C, C), diagonal included
    q_dec = qc * cum_exp
    k_dec_t = (kc * (cum[..., -1:] - cum).exp().unsqueeze(-1)).transpose(-1, -2)  # (M,H,Dk,C)
    chunk_decay = cum[..., -1].exp()[..., None, None]  # (M, H, 1, 1)
    k_rows = kc if at else None  # captures inside a chunk need the raw keys
    del qc, kc, vc, gc, bc, decay, k_beta, kt, system, eye, inv, cum_exp

    out = torch.empty(num_chunks, heads, c, dv, dtype=torch.float32, device=device)
    state = state0[order]  # sorted order: active sequences of each step are a prefix
    for j, (off, n_act) in enumerate(zip(step_offsets, step_counts)):
        sl = slice(off, off + n_act)
        s_act = state[:n_act]
        delta = u[sl] - w[sl] @ s_act
        out[sl] = q_dec[sl] @ s_act + attn[sl] @ delta
        for m, r, row in at.get(j, ()):
            # The exit-state line with the chunk ending after ``row``: Delta_i depends only on
            # tokens <= i (the system is lower triangular), so its first rows are the cut's.
            i, n = off + r, row + 1
            k_dec = k_rows[i, :, :n] * (cum[i, :, row:n] - cum[i, :, :n]).exp().unsqueeze(-1)
            cap[1][m] = (s_act[r] * cum[i, :, row].exp()[:, None, None]
                         + k_dec.transpose(-1, -2) @ delta[r, :, :n])
        new = s_act * chunk_decay[sl] + k_dec_t[sl] @ delta
        state = torch.cat([new, state[n_act:]], dim=0) if n_act < state.shape[0] else new
        for m, r in at_end.get(j, ()):
            cap[1][m] = state[r]

    final = torch.empty_like(state)
    final[order] = state
    o = out.transpose(1, 2).reshape(num_chunks * c, heads, dv)[flat]
    return o.to(v.dtype), final


GdnKernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]

GDN_KERNELS: dict[str, GdnKernel] = {
    "naive": gdn_naive,
    "chunked": gdn_chunked,
    "recurrent": gdn_recurrent,
}


# The verify forms (speculative decoding): the state after every token.
gdn_verify_naive = per_token(gdn_naive)
gdn_verify = per_token(gdn_recurrent)


def torch_chunk_size(cu_seqlens: torch.Tensor, largest: int = 64) -> int:
    """Chunk length for ``gdn_chunked``: the longest sequence rounded up to a power of two,
    at most ``largest``. Every sequence is padded to whole chunks, so under chunked prefill
    (a few tokens per request per step) 64-token chunks would be mostly padding; the result
    is the same up to float rounding whatever the chunk length."""
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 1
    return min(largest, 1 << max(longest - 1, 0).bit_length())
