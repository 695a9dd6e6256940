"""Paged attention's torch forms and per-step metadata: the blockwise decode over the block
tables, SDPA per prefill chunk (two flash calls merged for a later chunk of a prompt), the
K/V reads, and :class:`AttentionMetadata` (one per attention group and step).

Cache layout per layer: ``(num_blocks, block_size, 2, num_kv_heads, head_dim)``; flat slot
``s = block_id * block_size + offset`` addresses one token's K and V.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagefold.ops.attention.kv_quant import KVScales, is_fp8


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
    # The query rows of each image of a model whose image tokens attend to each other both
    # ways (Gemma 3), one row per image piece in the step (never the end of a chunk that is
    # cut: the scheduler keeps an image's tokens in one chunk): ``ctx_len`` is the image
    # piece's first position and ``kv_slots`` hold keys ``kv_start .. last image token``.
    # :func:`image_rows_attention` recomputes these rows after the causal paths.
    image_rows: list[PrefillRow] = field(default_factory=list)
    sliding_window: int | None = None
    all_decode: bool = False  # every row of the batch is a decode row (decode_tok = arange)
    _blockwise: tuple | None = None
    _prefill_pack: tuple | None = None
    _triton_pack: tuple | None = None  # the Triton prefill kernel's rows/slots/tiles

    def forget_derived(self) -> None:
        """Drop the views built from the tensors on first use (:meth:`blockwise`, the packs):
        for a caller that changed the tensors in place (a decode burst's next step)."""
        self._blockwise = self._prefill_pack = self._triton_pack = None

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


def fp8_scales(cache: torch.Tensor, kv_scales: KVScales | None) -> KVScales:
    if kv_scales is not None:
        return kv_scales
    return KVScales.unit(cache.shape[3], cache.shape[4], cache.device)


def read_kv(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype,
            kv_scales: KVScales | None = None) -> torch.Tensor:
    flat = cache.view(-1, *cache.shape[2:])
    if is_fp8(cache.dtype):
        return fp8_scales(cache, kv_scales).dequantize(flat[slots], dtype)
    return flat[slots].to(dtype)  # (n, 2, kvh, d)


def decode_torch(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
            kv_scales: KVScales | None = None):
    """Blockwise attention for single-token queries, in torch. q (B, H, D) -> (B, H, D) f32.
    An FP8 cache is dequantized by ``kv_scales`` and the whole row computed in float32."""
    b, h, d = q.shape
    blocks_ids, row, block_mask, rb = meta.blockwise()
    blocks = cache[blocks_ids]  # (Nb, bs, 2, KVH, D)
    if is_fp8(cache.dtype):
        blocks = fp8_scales(cache, kv_scales).dequantize(blocks, torch.float32)
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


def prefill_mask(ctx_len: int, kv_start: int, q_len: int, window: int | None,
                  device: torch.device) -> torch.Tensor:
    qpos = torch.arange(ctx_len, ctx_len + q_len, device=device).unsqueeze(1)
    kpos = torch.arange(kv_start, ctx_len + q_len, device=device).unsqueeze(0)
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    return mask


flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def sdpa_after_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pk: torch.Tensor,
                       pv: torch.Tensor, scale: float) -> torch.Tensor:
    """A later chunk of a prompt: q/k/v (1, H|KVH, L, D) the chunk's own, pk/pv (1, KVH, C, D)
    the C keys cached before it -> (1, H, L, D) float32.

    Every query sees the whole prefix and the chunk causally. One SDPA call with that mask
    would compute (and then discard) the masked upper triangle and build an additive mask of
    L x (C + L); instead the prefix (no mask) and the chunk (``is_causal``, square) are two
    flash calls whose partial results merge by their log-sum-exps: ~L*C + L*L/2 products
    instead of L*(C + L)."""
    oa, la = flash_cpu(q, pk, pv, 0.0, False, scale=scale)
    ob, lb = flash_cpu(q, k, v, 0.0, True, scale=scale)
    # The prefix's share of each row's softmax mass: e^la / (e^la + e^lb) = sigmoid(la - lb).
    return torch.lerp(ob.float(), oa.float(), torch.sigmoid(la - lb).unsqueeze(-1))


def prefill_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float, prefills: list[PrefillRow],
                 out: torch.Tensor, kv_scales: KVScales | None = None,
                 after_prefix: bool = False) -> None:
    """Prefill chunks (query length > 1) by SDPA, one call per chunk against its whole
    context (the cache's keys; a fresh chunk's own k/v), a causal mask offset by the tokens
    cached before it; writes their rows of ``out``. ``after_prefix``: a later chunk of a
    prompt takes :func:`sdpa_after_prefix` (two flash calls) where it applies."""
    h, kvh = q.shape[1], k.shape[1]
    fp8 = is_fp8(cache.dtype)
    for row in prefills:
        qs = q[row.tok_start : row.tok_end]
        if (row.ctx_len and after_prefix and flash_cpu is not None
                and meta.sliding_window is None and cache.dtype == q.dtype):
            # The prefix fills whole pages from position 0: gather pages, not slots.
            pages = row.kv_slots[: row.ctx_len : meta.block_size] // meta.block_size
            kv = cache.index_select(0, pages).flatten(0, 1)[: row.ctx_len]
            o = sdpa_after_prefix(*(x.transpose(0, 1).unsqueeze(0) for x in (
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
            mask = prefill_mask(row.ctx_len, row.kv_start, q_len, meta.sliding_window,
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


def image_rows_attention(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                         scale: float, out: torch.Tensor,
                         kv_scales: KVScales | None = None) -> None:
    """Rewrite ``out``'s rows of ``meta.image_rows``: a query of an image token sees every key
    up to the image's last token (the image's later tokens too: transformers'
    ``OR(causal, same image)``) and, under a sliding window, only keys within the window of
    its own position (``AND(window, ...)``: later tokens of the image always are). Keys and
    values are read from the cache, which holds the whole chunk by now."""
    h = q.shape[1]
    dtype = torch.float32 if is_fp8(cache.dtype) else q.dtype
    for row in meta.image_rows:
        qs = q[row.tok_start : row.tok_end].to(dtype)
        kv = read_kv(cache, row.kv_slots, dtype, kv_scales)
        end = row.ctx_len + qs.shape[0]
        mask = None
        if meta.sliding_window is not None:
            qpos = torch.arange(row.ctx_len, end, device=q.device)
            kpos = torch.arange(row.kv_start, end, device=q.device)
            mask = kpos[None, :] > qpos[:, None] - meta.sliding_window
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1).unsqueeze(0), kv[:, 0].transpose(0, 1).unsqueeze(0),
            kv[:, 1].transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale,
            enable_gqa=h != kv.shape[2])
        out[row.tok_start : row.tok_end] = o.squeeze(0).transpose(0, 1).to(out.dtype)
