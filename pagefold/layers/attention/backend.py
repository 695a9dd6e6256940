"""Paged attention for the CPU, in torch: one flat varlen batch mixing prefills and decodes.

Cache layout per layer: ``(num_blocks, block_size, 2, num_kv_heads, head_dim)``; flat slot
``s = block_id * block_size + offset`` addresses one token's K and V.

* Decode rows (query length 1) are computed together, block by block: every (row, block) pair
  is one entry of a batched matmul, so no row is padded to the longest; a softmax across each
  row's blocks (segment max and sum) combines them. Only the tail of a row's last block is
  masked.
* Prefill rows (query length > 1, possibly a later chunk of a prompt) run one SDPA call each
  against their whole context, with a causal mask offset by the tokens already cached.

A CUDA backend plugs in by providing the same ``forward(q, k, v, cache, meta, scale)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillRow:
    tok_start: int  # first query row in the flat batch
    tok_end: int
    ctx_len: int  # tokens cached before this chunk
    kv_start: int  # position of the first key read (> 0 only under a sliding window)
    kv_slots: torch.Tensor  # (ctx_len + chunk - kv_start,) flat slots of the keys, in order


@dataclass(slots=True)
class AttentionMetadata:
    """Per attention group, per step. Shared by every layer of the group."""

    slot_mapping: torch.Tensor  # (T,) where each new token's K/V goes
    decode_tok: torch.Tensor  # (Bd,) flat rows that are single-token queries
    decode_blocks: torch.Tensor  # (Nb,) block ids read by decode rows, row after row
    decode_block_row: torch.Tensor  # (Nb,) decode row index (0..Bd-1) of each block
    decode_block_mask: torch.Tensor | None  # (Nb, block_size) valid keys; None if all valid
    decode_row_blocks: torch.Tensor  # (Bd, max blocks per row) index into Nb; Nb = padding
    prefills: list[PrefillRow] = field(default_factory=list)
    sliding_window: int | None = None


def write_kv(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    flat = cache.view(-1, *cache.shape[2:])  # (num_slots, 2, kvh, d)
    flat[slots] = torch.stack((k, v), dim=1).to(cache.dtype)


def read_kv(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    flat = cache.view(-1, *cache.shape[2:])
    return flat[slots].to(dtype)  # (n, 2, kvh, d)


def _decode(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float):
    """Blockwise attention for single-token queries. q (B, H, D) -> (B, H, D)."""
    b, h, d = q.shape
    blocks = cache[meta.decode_blocks]  # (Nb, bs, 2, KVH, D)
    kvh = blocks.shape[3]
    g = h // kvh
    row = meta.decode_block_row
    keys = blocks[:, :, 0].transpose(1, 2).to(q.dtype)  # (Nb, KVH, bs, D)
    vals = blocks[:, :, 1].transpose(1, 2).to(q.dtype)
    qb = q.view(b, kvh, g, d)[row]  # (Nb, KVH, G, D)
    scores = torch.matmul(qb, keys.transpose(-1, -2)).float() * scale  # (Nb, KVH, G, bs)
    if meta.decode_block_mask is not None:
        scores.masked_fill_(~meta.decode_block_mask[:, None, None, :], float("-inf"))
        # p is 0 at masked keys, but 0 * NaN = NaN: unwritten slots (stale bytes, NaN) must
        # not reach the value product.
        vals = vals.masked_fill(~meta.decode_block_mask[:, None, :, None], 0)
    # Per-row reductions over a (rows, blocks-per-row) map of the block list; the map's padding
    # points at one extra neutral entry (-inf for the max, 0 for sums).
    rb = meta.decode_row_blocks
    bmax = torch.cat((scores.amax(-1), torch.full((1, kvh, g), float("-inf"))))
    rmax = bmax[rb].amax(1)  # (B, KVH, G)
    p = torch.exp(scores - rmax[row].unsqueeze(-1))
    zero = torch.zeros((1, kvh, g))
    denom = torch.cat((p.sum(-1), zero))[rb].sum(1)
    ob = torch.matmul(p.to(vals.dtype), vals).float()  # (Nb, KVH, G, D)
    out = torch.cat((ob, zero.unsqueeze(-1).expand(1, kvh, g, d)))[rb].sum(1)
    return (out / denom.unsqueeze(-1)).view(b, h, d)


def _prefill_mask(ctx_len: int, kv_start: int, q_len: int, window: int | None) -> torch.Tensor:
    qpos = torch.arange(ctx_len, ctx_len + q_len).unsqueeze(1)
    kpos = torch.arange(kv_start, ctx_len + q_len).unsqueeze(0)
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    return mask


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q (T, H, D), k/v (T, KVH, D) -> (T, H, D). Writes k/v into the cache first."""
    write_kv(cache, meta.slot_mapping, k, v)
    out = torch.empty_like(q)
    if meta.decode_tok.numel():
        qd = q[meta.decode_tok]
        out[meta.decode_tok] = _decode(qd, cache, meta, scale).to(q.dtype)
    h, kvh = q.shape[1], k.shape[1]
    for row in meta.prefills:
        qs = q[row.tok_start : row.tok_end]
        if row.ctx_len == 0 and cache.dtype == q.dtype:
            keys, vals = k[row.tok_start : row.tok_end], v[row.tok_start : row.tok_end]
        else:
            kv = read_kv(cache, row.kv_slots, q.dtype)
            keys, vals = kv[:, 0], kv[:, 1]
        q_len = qs.shape[0]
        if row.ctx_len == 0 and meta.sliding_window is None:
            mask, causal = None, True
        else:
            mask = _prefill_mask(row.ctx_len, row.kv_start, q_len, meta.sliding_window)
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
        out[row.tok_start : row.tok_end] = o.squeeze(0).transpose(0, 1)
    return out
