"""Paged attention for the CPU: one flat varlen batch mixing prefills and decodes.

Cache layout per layer: ``(num_blocks, block_size, 2, num_kv_heads, head_dim)``; flat slot
``s = block_id * block_size + offset`` addresses one token's K and V.

* Prefill chunks (bf16 on a CPU with AVX-512 BF16): the compiled kernels
  (:func:`pagefold.csrc.cpu_ops.prefill_attention`: the blocked kernel for head dims that are
  multiples of 32, on AMX tiles where the CPU has them) read their keys from the pages;
  otherwise SDPA per chunk, as below. On AMX CPUs, for other head dims, chunks of
  ``cpu_ops.SDPA_MIN_TOKENS`` tokens or more take SDPA (its bf16 products on AMX tiles).
* Decode rows (query length 1): the compiled kernel (:mod:`pagefold.csrc.cpu_ops`) walks each
  row's block table and reads K/V in place, one online softmax per (row, kv head) shared by the
  query heads of the group. Without it (no compiler, another device, other dtypes), a torch
  path computes all rows together, block by block: every (row, block) pair is one entry of a
  batched matmul, so no row is padded to the longest; a softmax across each row's blocks
  (segment max and sum) combines them. Only keys outside a row's range are masked.
* Prefill rows (query length > 1, possibly a later chunk of a prompt) run one SDPA call each
  against their whole context, with a causal mask offset by the tokens already cached.

A CUDA backend plugs in by providing the same ``forward(q, k, v, cache, meta, scale)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagefold.csrc import cpu_ops
from pagefold.kernels import dispatch
from pagefold.layers.attention.kv_quant import KVScales, is_fp8


@dataclass(slots=True)
class PrefillRow:
    tok_start: int  # first query row in the flat batch
    tok_end: int
    ctx_len: int  # tokens cached before this chunk
    kv_start: int  # position of the first key read (> 0 only under a sliding window)
    kv_slots: torch.Tensor  # (ctx_len + chunk - kv_start,) flat slots of the keys, in order


@dataclass(slots=True)
class AttentionMetadata:
    """Per attention group, per step. Shared by every layer of the group.

    Decode rows (query length 1) are described by their block tables: row ``i`` attends to
    key positions ``decode_kv_start[i] .. decode_seq_lens[i] - 1`` (the new token included),
    position ``p`` at slot ``decode_tables[i, p // bs] * bs + p % bs``. The compiled kernel
    reads those blocks in place; the torch path builds a (row, block) map from them once per
    step, on first use (:meth:`blockwise`).
    """

    slot_mapping: torch.Tensor  # (T,) where each new token's K/V goes
    decode_tok: torch.Tensor  # (Bd,) flat rows attending as single-token queries
    decode_tables: torch.Tensor  # (Bd, W) block tables of the decode rows (W >= 1)
    decode_seq_lens: torch.Tensor  # (Bd,) keys per decode row, the new one included
    decode_kv_start: torch.Tensor | None  # (Bd,) first key read (sliding window) or None: 0
    block_size: int
    prefills: list[PrefillRow] = field(default_factory=list)
    sliding_window: int | None = None
    all_decode: bool = False  # every row of the batch is a decode row (decode_tok = arange)
    _blockwise: tuple | None = None
    _prefill_pack: tuple | None = None
    _triton_pack: tuple | None = None  # the Triton prefill kernel's rows/slots/tiles

    def prefill_pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The compiled prefill kernel's view of :attr:`prefills`, built once per step:
        ``rows`` (R, 5) int64 ``tok_start, q_len, ctx_len, kv_start, slot_off`` and every
        chunk's ``kv_slots`` concatenated (``slot_off`` indexes into it)."""
        if self._prefill_pack is None:
            table, off = [], 0
            for r in self.prefills:
                table.append((r.tok_start, r.tok_end - r.tok_start, r.ctx_len, r.kv_start, off))
                off += r.kv_slots.shape[0]
            rows = torch.tensor(table, dtype=torch.int64).reshape(-1, 5)
            slots = torch.cat([r.kv_slots for r in self.prefills]).to("cpu", torch.int64)
            self._prefill_pack = (rows, slots)
        return self._prefill_pack

    def blockwise(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The torch path's view: every block a decode row reads, row after row.

        Returns ``(blocks (Nb,), block_row (Nb,), block_mask (Nb, bs) or None, row_blocks
        (Bd, max blocks per row))``: ``blocks`` are block ids, ``block_row`` the decode row of
        each, ``block_mask`` the valid keys (None when all are), ``row_blocks`` indexes into
        the Nb entries with Nb as padding.
        """
        if self._blockwise is None:
            self._blockwise = _blockwise_map(self.decode_tables, self.decode_seq_lens,
                                             self.decode_kv_start, self.block_size)
        return self._blockwise

    @property
    def decode_blocks(self) -> torch.Tensor:
        return self.blockwise()[0]

    @property
    def decode_block_row(self) -> torch.Tensor:
        return self.blockwise()[1]

    @property
    def decode_block_mask(self) -> torch.Tensor | None:
        return self.blockwise()[2]

    @property
    def decode_row_blocks(self) -> torch.Tensor:
        return self.blockwise()[3]


def _blockwise_map(tables: torch.Tensor, seq_len: torch.Tensor, kv_start: torch.Tensor | None,
                   bs: int) -> tuple:
    dev = tables.device
    i64 = torch.int64
    lo_blk = kv_start // bs if kv_start is not None else torch.zeros_like(seq_len)
    hi_blk = (seq_len + bs - 1) // bs
    nblk = hi_blk - lo_blk
    nrows = seq_len.shape[0]
    row = torch.repeat_interleave(torch.arange(nrows, device=dev), nblk)
    bcu = torch.zeros(nrows + 1, dtype=i64, device=dev)
    torch.cumsum(nblk, 0, out=bcu[1:])
    total = int(bcu[-1])
    col = torch.arange(total, device=dev) - bcu[:-1][row]
    blk_idx = col + lo_blk[row]
    blocks = tables[row, blk_idx]
    kpos = blk_idx.unsqueeze(1) * bs + torch.arange(bs, device=dev).unsqueeze(0)  # (Nb, bs)
    valid = kpos < seq_len[row].unsqueeze(1)
    if kv_start is not None:
        valid &= kpos >= kv_start[row].unsqueeze(1)
    mask = None if bool(valid.all()) else valid
    width = int(nblk.max()) if nrows else 0
    row_blocks = torch.full((nrows, width), total, dtype=i64, device=dev)
    row_blocks[row, col] = torch.arange(total, device=dev)
    return blocks, row, mask, row_blocks


def _fp8_scales(cache: torch.Tensor, kv_scales: KVScales | None) -> KVScales:
    if kv_scales is not None:
        return kv_scales
    return KVScales.unit(cache.shape[3], cache.shape[4], cache.device)


def write_kv(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             kv_scales: KVScales | None = None) -> None:
    """Store k, v (N, KVH, D) at flat ``slots``; an FP8 cache stores them encoded by
    ``kv_scales`` (unit scales when None) with a saturating cast."""
    if is_fp8(cache.dtype):
        k, v = _fp8_scales(cache, kv_scales).quantize(k, v, cache.dtype)
    elif cpu_ops.write_kv(cache, slots, k, v):
        return
    flat = cache.view(-1, *cache.shape[2:])  # (num_slots, 2, kvh, d)
    flat[slots] = torch.stack((k, v), dim=1).to(cache.dtype)


def read_kv(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype,
            kv_scales: KVScales | None = None) -> torch.Tensor:
    flat = cache.view(-1, *cache.shape[2:])
    if is_fp8(cache.dtype):
        return _fp8_scales(cache, kv_scales).dequantize(flat[slots], dtype)
    return flat[slots].to(dtype)  # (n, 2, kvh, d)


def _decode(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
            kv_scales: KVScales | None = None):
    """Blockwise attention for single-token queries, in torch. q (B, H, D) -> (B, H, D) f32.
    An FP8 cache is dequantized by ``kv_scales`` and the whole row computed in float32."""
    b, h, d = q.shape
    blocks_ids, row, block_mask, rb = meta.blockwise()
    blocks = cache[blocks_ids]  # (Nb, bs, 2, KVH, D)
    if is_fp8(cache.dtype):
        blocks = _fp8_scales(cache, kv_scales).dequantize(blocks, torch.float32)
        q = q.float()
    kvh = blocks.shape[3]
    g = h // kvh
    dev = q.device
    keys = blocks[:, :, 0].transpose(1, 2).to(q.dtype)  # (Nb, KVH, bs, D)
    vals = blocks[:, :, 1].transpose(1, 2).to(q.dtype)
    qb = q.view(b, kvh, g, d)[row]  # (Nb, KVH, G, D)
    scores = torch.matmul(qb, keys.transpose(-1, -2)).float() * scale  # (Nb, KVH, G, bs)
    if block_mask is not None:
        scores.masked_fill_(~block_mask[:, None, None, :], float("-inf"))
        # p is 0 at masked keys, but 0 * NaN = NaN: unwritten slots (stale bytes, NaN) must
        # not reach the value product. Only blocks with a masked key are rewritten.
        partial = torch.nonzero(~block_mask.all(1)).flatten()
        vals[partial] = vals[partial].masked_fill(~block_mask[partial][:, None, :, None], 0)
    # Per-row reductions over a (rows, blocks-per-row) map of the block list; the map's padding
    # points at one extra neutral entry (-inf for the max, 0 for sums).
    bmax = torch.cat((scores.amax(-1), torch.full((1, kvh, g), float("-inf"), device=dev)))
    rmax = bmax[rb].amax(1)  # (B, KVH, G)
    p = torch.exp(scores - rmax[row].unsqueeze(-1))
    zero = torch.zeros((1, kvh, g), device=dev)
    denom = torch.cat((p.sum(-1), zero))[rb].sum(1)
    ob = torch.matmul(p.to(vals.dtype), vals).float()  # (Nb, KVH, G, D)
    out = torch.cat((ob, zero.unsqueeze(-1).expand(1, kvh, g, d)))[rb].sum(1)
    return (out / denom.unsqueeze(-1)).view(b, h, d)


def _prefill_mask(ctx_len: int, kv_start: int, q_len: int, window: int | None,
                  device: torch.device) -> torch.Tensor:
    qpos = torch.arange(ctx_len, ctx_len + q_len, device=device).unsqueeze(1)
    kpos = torch.arange(kv_start, ctx_len + q_len, device=device).unsqueeze(0)
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    return mask


# A later chunk of a prompt (keys cached before it) goes to SDPA when its (query, key) pairs
# reach this many: SDPA's per-pair cost is ~0.3x the compiled kernel's on AMX, but the two
# calls, the page gather and the merge cost a fixed ~0.2 ms per layer (SmolLM2, 2 threads:
# 24 tokens after 2,000 break even, 128 after 160; 256 after 2,000 take 0.38x the kernel's).
SDPA_MIN_PAIRS = 40_000


def _sdpa_prefills(meta: AttentionMetadata, head_dim: int) -> torch.Tensor | None:
    """Which prefill chunks SDPA computes rather than the compiled kernels
    (``cpu_ops.SDPA_MIN_TOKENS``: no window, long enough, a head dim the blocked kernels do
    not take; fresh chunks and later chunks of a prompt alike, see
    :func:`_sdpa_after_prefix`), as a bool mask over ``meta.prefills``; None when none does."""
    least = cpu_ops.SDPA_MIN_TOKENS
    if least is None or meta.sliding_window is not None or cpu_ops.prefill_tiles(head_dim):
        return None
    pick = [n >= least if not r.ctx_len else n * (r.ctx_len + n // 2) >= SDPA_MIN_PAIRS
            for r in meta.prefills for n in (r.tok_end - r.tok_start,)]
    return torch.tensor(pick) if any(pick) else None


_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _sdpa_after_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pk: torch.Tensor,
                       pv: torch.Tensor, scale: float) -> torch.Tensor:
    """A later chunk of a prompt: q/k/v (1, H|KVH, L, D) the chunk's own, pk/pv (1, KVH, C, D)
    the C keys cached before it -> (1, H, L, D) float32.

    Every query sees the whole prefix and the chunk causally. One SDPA call with that mask
    would compute (and then discard) the masked upper triangle and build an additive mask of
    L x (C + L); instead the prefix (no mask) and the chunk (``is_causal``, square) are two
    flash calls whose partial results merge by their log-sum-exps: ~L*C + L*L/2 products
    instead of L*(C + L)."""
    oa, la = _flash_cpu(q, pk, pv, 0.0, False, scale=scale)
    ob, lb = _flash_cpu(q, k, v, 0.0, True, scale=scale)
    # The prefix's share of each row's softmax mass: e^la / (e^la + e^lb) = sigmoid(la - lb).
    return torch.lerp(ob.float(), oa.float(), torch.sigmoid(la - lb).unsqueeze(-1))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: KVScales | None = None,
) -> torch.Tensor:
    """q (T, H, D), k/v (T, KVH, D) -> (T, H, D). Writes k/v into the cache first.

    ``kv_scales``: the layer's FP8 encoding (an FP8 cache only). Every path reads what the
    cache holds (a chunk's own keys included), so a prefix-cache hit computes what a fresh
    prefill would; FP8 attention runs in float32 on the dequantized values."""
    if kv_scales is None and not is_fp8(cache.dtype):
        out = dispatch.paged_attention(q, k, v, cache, meta, scale)  # Triton (CUDA by default)
        if out is not None:
            return out
    write_kv(cache, meta.slot_mapping, k, v, kv_scales)
    out = torch.empty_like(q)
    fp8 = is_fp8(cache.dtype)
    if meta.decode_tok.numel():
        rows = None if meta.all_decode else meta.decode_tok
        if fp8 or not cpu_ops.decode_attention(q, rows, cache, meta.decode_tables,
                                                meta.decode_seq_lens, meta.decode_kv_start,
                                                scale, out):
            qd = q if rows is None else q[rows]
            od = _decode(qd, cache, meta, scale, kv_scales).to(q.dtype)
            if rows is None:
                out = od
            else:
                out[rows] = od
    h, kvh = q.shape[1], k.shape[1]
    prefills = meta.prefills
    to_sdpa = None
    if prefills and q.device.type == "cpu" and q.dtype == torch.bfloat16 and not fp8:
        rows, slots = meta.prefill_pack()
        to_sdpa = _sdpa_prefills(meta, q.shape[2]) if cache.dtype == q.dtype else None
        kernel_rows = rows if to_sdpa is None else rows[~to_sdpa]
        if kernel_rows.shape[0] == 0 or cpu_ops.prefill_attention(
                q, cache, kernel_rows, slots, meta.sliding_window, scale, out):
            if to_sdpa is None:
                return out
            prefills = [r for r, s in zip(prefills, to_sdpa.tolist()) if s]
    for row in prefills:
        qs = q[row.tok_start : row.tok_end]
        if (row.ctx_len and to_sdpa is not None and _flash_cpu is not None
                and meta.sliding_window is None and cache.dtype == q.dtype):
            # The prefix fills whole pages from position 0: gather pages, not slots.
            pages = row.kv_slots[: row.ctx_len : meta.block_size] // meta.block_size
            kv = cache.index_select(0, pages).flatten(0, 1)[: row.ctx_len]
            o = _sdpa_after_prefix(*(x.transpose(0, 1).unsqueeze(0) for x in (
                qs, k[row.tok_start : row.tok_end], v[row.tok_start : row.tok_end],
                kv[:, 0], kv[:, 1])), scale)
            out[row.tok_start : row.tok_end] = o.squeeze(0).transpose(0, 1).to(out.dtype)
            continue
        if row.ctx_len == 0 and cache.dtype == q.dtype:
            keys, vals = k[row.tok_start : row.tok_end], v[row.tok_start : row.tok_end]
        elif fp8:
            qs = qs.float()
            kv = read_kv(cache, row.kv_slots, torch.float32, kv_scales)
            keys, vals = kv[:, 0], kv[:, 1]
        else:
            kv = read_kv(cache, row.kv_slots, q.dtype)
            keys, vals = kv[:, 0], kv[:, 1]
        q_len = qs.shape[0]
        if row.ctx_len == 0 and meta.sliding_window is None:
            mask, causal = None, True
        else:
            mask = _prefill_mask(row.ctx_len, row.kv_start, q_len, meta.sliding_window,
                                 q.device)
            causal = False
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            vals.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=h != kvh,
        )
        out[row.tok_start : row.tok_end] = o.squeeze(0).transpose(0, 1).to(out.dtype)
    return out
