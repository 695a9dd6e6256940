"""Paged attention in Triton: the K/V write, decode rows and prefill chunks, read in place.

Same cache layout and metadata as :mod:`pagefold.ops.attention`: per layer
``(num_blocks, block_size, 2, KVH, D)``, flat slot ``s = block * block_size + offset``.

* :func:`write_kv` stores each new token's K and V at its slot (a negative slot is skipped:
  padding rows of a captured decode batch write nothing).
* Decode (:func:`decode_attention`): one program per (decode row, kv head) walks the row's
  block table ``BLOCK_N`` keys at a time (the block of key ``p`` is looked up per key, so any
  block size works) with an online softmax; the query heads of a GQA group share every K/V
  load. A row with no keys (a padding row) outputs zeros.
* Prefill (:func:`prefill_attention`): one program per (tile of ``BLOCK_M`` query rows of one
  chunk, query head); keys come from the chunk's ``kv_slots`` (prefix and the chunk itself, its
  own K/V already written), causal and sliding-window masks from positions.

:func:`paged_attention` has the signature of the torch path
(:func:`pagefold.ops.attention.paged_attention`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagefold.ops.common.triton import INTERPRET, dot_dtype, pow2

# Running maxima start at a finite "minus infinity" (-1e30, written inline: Triton kernels may
# read only constexpr globals), so exp(m_old - m_new) stays defined for rows with no key yet.


@triton.jit
def write_kv_kernel(k_ptr, v_ptr, k_st, k_sh, v_st, v_sh, slots_ptr, cache_ptr, N, KVH, D,
                     ROWS: tl.constexpr, BLOCK_F: tl.constexpr):
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    slot = tl.load(slots_ptr + i, mask=i < N, other=-1).to(tl.int64)[:, None]
    f = tl.arange(0, BLOCK_F)[None, :]  # head * D + dim
    h = f // D
    d = f % D
    m = (slot >= 0) & (f < KVH * D)
    i = i.to(tl.int64)[:, None]
    kv = tl.load(k_ptr + i * k_st + h * k_sh + d, mask=m)
    vv = tl.load(v_ptr + i * v_st + h * v_sh + d, mask=m)
    dst = cache_ptr + slot * (2 * KVH * D) + f
    tl.store(dst, kv.to(cache_ptr.dtype.element_ty), mask=m)
    tl.store(dst + KVH * D, vv.to(cache_ptr.dtype.element_ty), mask=m)


def write_kv(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store k, v (N, KVH, D) at flat ``slots`` (N,) of ``cache`` (negative slots skipped)."""
    n, kvh, d = k.shape
    if n == 0:
        return
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    rows = min(pow2(n), 64) if INTERPRET else 1
    write_kv_kernel[(triton.cdiv(n, rows),)](
        k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), slots.contiguous(), cache, n,
        kvh, d, ROWS=rows, BLOCK_F=pow2(kvh * d))


@triton.jit
def decode_kernel(q_ptr, q_st, q_sh, rows_ptr, cache_ptr, tables_ptr, t_st, seq_lens_ptr,
                   kv_start_ptr, out_ptr, o_st, o_sh, scale, KVH, G, D, BS,
                   HAS_ROWS: tl.constexpr, HAS_START: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
                   PREC: tl.constexpr):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    row = tl.load(rows_ptr + b) if HAS_ROWS else b
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    qm = (g[:, None] < G) & (d[None, :] < D)
    heads = kh * G + g
    q = tl.load(q_ptr + row * q_st + heads[:, None] * q_sh + d[None, :], mask=qm, other=0.0)
    q = q.to(DOT)
    seq_len = tl.load(seq_lens_ptr + b)
    lo = tl.load(kv_start_ptr + b) if HAS_START else 0
    m_i = tl.full((BLOCK_G,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    slot_stride = 2 * KVH * D
    start = (lo // BLOCK_N) * BLOCK_N
    for n0 in range(start, seq_len, BLOCK_N):
        p = n0 + tl.arange(0, BLOCK_N)
        valid = (p < seq_len) & (p >= lo)
        blk = tl.load(tables_ptr + b * t_st + p // BS, mask=valid, other=0).to(tl.int64)
        base = (blk * BS + p % BS) * slot_stride + kh * D
        km = valid[:, None] & (d[None, :] < D)
        k = tl.load(cache_ptr + base[:, None] + d[None, :], mask=km, other=0.0)
        s = tl.dot(q, tl.trans(k.to(DOT)), input_precision=PREC) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        pr = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        vv = tl.load(cache_ptr + base[:, None] + KVH * D + d[None, :], mask=km, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(pr.to(DOT), vv.to(DOT), input_precision=PREC)
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + row * o_st + heads[:, None] * o_sh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=qm)


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 or INTERPRET else "tf32"


def decode_attention(q: torch.Tensor, rows: torch.Tensor | None, cache: torch.Tensor,
                     tables: torch.Tensor, seq_lens: torch.Tensor,
                     kv_starts: torch.Tensor | None, scale: float, out: torch.Tensor) -> None:
    """Single-token attention of the decode rows (``rows`` of q/out, or all rows when None);
    same contract as :func:`pagefold.ops.attention.cpu.decode_attention`."""
    _, h, d = q.shape
    _, bs, _, kvh, _ = cache.shape
    nb = seq_lens.shape[0]
    if nb == 0:
        return
    g = h // kvh
    tables = tables.contiguous()
    dummy = seq_lens
    decode_kernel[(nb, kvh)](
        q, q.stride(0), q.stride(1), rows if rows is not None else dummy, cache, tables,
        tables.stride(0), seq_lens.contiguous(),
        kv_starts.contiguous() if kv_starts is not None else dummy, out, out.stride(0),
        out.stride(1), float(scale), kvh, g, d, bs, HAS_ROWS=rows is not None,
        HAS_START=kv_starts is not None, BLOCK_G=pow2(g, 16), BLOCK_D=pow2(d, 16),
        BLOCK_N=64, DOT=dot_dtype(q.dtype), PREC=_prec(q.dtype))


@triton.jit
def prefill_kernel(q_ptr, q_st, q_sh, cache_ptr, slots_ptr, rows_ptr, tiles_ptr, out_ptr,
                    o_st, o_sh, scale, KVH, G, D, WINDOW,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    DOT: tl.constexpr, PREC: tl.constexpr):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // G
    r = tl.load(tiles_ptr + 2 * tile)
    m0 = tl.load(tiles_ptr + 2 * tile + 1)
    tok_start = tl.load(rows_ptr + 5 * r)
    q_len = tl.load(rows_ptr + 5 * r + 1)
    ctx_len = tl.load(rows_ptr + 5 * r + 2)
    kv_start = tl.load(rows_ptr + 5 * r + 3)
    slot_off = tl.load(rows_ptr + 5 * r + 4)
    mi = m0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    qmask = (mi[:, None] < q_len) & (d[None, :] < D)
    toks = tok_start + mi
    q = tl.load(q_ptr + toks[:, None] * q_st + h * q_sh + d[None, :], mask=qmask, other=0.0)
    q = q.to(DOT)
    qpos = ctx_len + mi
    q_hi = tl.minimum(m0 + BLOCK_M, q_len)
    kv_hi = ctx_len + q_hi  # keys up to the tile's last query, inclusive
    kv_lo = kv_start
    if WINDOW > 0:
        kv_lo = tl.maximum(kv_lo, ctx_len + m0 - WINDOW + 1)
    m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    slot_stride = 2 * KVH * D
    for n0 in range(kv_lo, kv_hi, BLOCK_N):
        kp = n0 + tl.arange(0, BLOCK_N)
        kvalid = kp < kv_hi
        slot = tl.load(slots_ptr + slot_off + kp - kv_start, mask=kvalid, other=0).to(tl.int64)
        base = slot * slot_stride + kh * D
        km = kvalid[:, None] & (d[None, :] < D)
        k = tl.load(cache_ptr + base[:, None] + d[None, :], mask=km, other=0.0)
        s = tl.dot(q, tl.trans(k.to(DOT)), input_precision=PREC) * scale
        vis = kvalid[None, :] & (kp[None, :] <= qpos[:, None])
        if WINDOW > 0:
            vis = vis & (kp[None, :] > qpos[:, None] - WINDOW)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        pr = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        vv = tl.load(cache_ptr + base[:, None] + KVH * D + d[None, :], mask=km, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(pr.to(DOT), vv.to(DOT), input_precision=PREC)
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + toks[:, None] * o_st + h * o_sh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=qmask)


PREFILL_BLOCK_M = 16


def prefill_pack(prefills, device: torch.device, block_m: int = PREFILL_BLOCK_M
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device tensors the prefill kernel reads: ``rows`` (R, 5) int64 ``tok_start, q_len,
    ctx_len, kv_start, slot_off``, every chunk's key slots concatenated, and the ``tiles``
    (NT, 2) int64 ``(row, first query of the tile)``; built from the host-side row fields."""
    table, tiles, off = [], [], 0
    for i, r in enumerate(prefills):
        q_len = r.tok_end - r.tok_start
        table.append((r.tok_start, q_len, r.ctx_len, r.kv_start, off))
        tiles.extend((i, m0) for m0 in range(0, q_len, block_m))
        off += r.kv_slots.shape[0]
    rows = torch.tensor(table, dtype=torch.int64).reshape(-1, 5).to(device, non_blocking=True)
    tiles_t = torch.tensor(tiles, dtype=torch.int64).reshape(-1, 2).to(device,
                                                                       non_blocking=True)
    slots = torch.cat([r.kv_slots.to(device, torch.int64) for r in prefills])
    return rows, slots, tiles_t


def prefill_attention(q: torch.Tensor, cache: torch.Tensor, pack, window: int | None,
                      scale: float, out: torch.Tensor) -> None:
    """Causal attention of the prefill chunks in ``pack`` (:func:`prefill_pack`) over the
    paged cache, their own K/V already written; writes their rows of ``out``."""
    rows, slots, tiles = pack
    if tiles.shape[0] == 0:
        return
    _, h, d = q.shape
    kvh = cache.shape[3]
    prefill_kernel[(tiles.shape[0], h)](
        q, q.stride(0), q.stride(1), cache, slots, rows, tiles, out, out.stride(0),
        out.stride(1), float(scale), kvh, h // kvh, d, int(window or 0),
        BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=32, BLOCK_D=pow2(d, 16), DOT=dot_dtype(q.dtype),
        PREC=_prec(q.dtype))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                    meta, scale: float) -> torch.Tensor:
    """q (T, H, D), k/v (T, KVH, D) -> (T, H, D); writes k/v into the cache first. The
    signature of :func:`pagefold.ops.attention.paged_attention`."""
    write_kv(cache, meta.slot_mapping, k, v)
    if q.stride(2) != 1:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if meta.decode_tok.numel():
        rows = None if meta.all_decode else meta.decode_tok
        decode_attention(q, rows, cache, meta.decode_tables, meta.decode_seq_lens,
                         meta.decode_kv_start, scale, out)
    if meta.prefills:
        if meta._triton_pack is None:
            meta._triton_pack = prefill_pack(meta.prefills, q.device)
        prefill_attention(q, cache, meta._triton_pack, meta.sliding_window, scale, out)
    return out
