"""Paged attention over one flat varlen batch mixing prefills and decodes: the one entry
layers call (:func:`paged_attention`, :func:`write_kv`, :func:`read_kv`), which owns the route.

* ``PAGEFOLD_KERNELS`` selects Triton for the device (:mod:`pagefold.kernels.dispatch`): the
  Triton kernels of :mod:`.triton` (not for FP8 caches).

Cache layout per layer: ``(num_blocks, block_size, 2, num_kv_heads, head_dim)``; flat slot
``s = block_id * block_size + offset`` addresses one token's K and V.

* Prefill chunks (bf16 on a CPU with AVX-512 BF16): the compiled kernels
  (:func:`.cpu.prefill_attention`: the blocked kernel for head dims that are
  multiples of 32, on AMX tiles where the CPU has them) read their keys from the pages;
  otherwise SDPA per chunk, as below. On AMX CPUs, for other head dims, chunks of
  ``cpu.SDPA_MIN_TOKENS`` tokens or more take SDPA (its bf16 products on AMX tiles).
* Decode rows (query length 1): the compiled kernel (:mod:`.cpu`) walks each
  row's block table and reads K/V in place, one online softmax per (row, kv head) shared by the
  query heads of the group. Without it (no compiler, another device, other dtypes), a torch
  path computes all rows together, block by block: every (row, block) pair is one entry of a
  batched matmul, so no row is padded to the longest; a softmax across each row's blocks
  (segment max and sum) combines them. Only keys outside a row's range are masked.
* Prefill rows (query length > 1, possibly a later chunk of a prompt) run one SDPA call each
  against their whole context, with a causal mask offset by the tokens already cached.

The torch forms and :class:`AttentionMetadata` are in :mod:`.reference`.
"""

from __future__ import annotations

import torch

from pagefold.kernels import dispatch
from pagefold.ops.attention import cpu
from pagefold.ops.attention.kv_quant import KVScales, is_fp8
from pagefold.ops.attention.reference import (
    AttentionMetadata,
    PrefillRow,
    decode_torch,
    fp8_scales,
    image_rows_attention,
    prefill_rows,
    read_kv,
)

__all__ = ["AttentionMetadata", "PrefillRow", "paged_attention", "read_kv", "write_kv"]


def write_kv(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             kv_scales: KVScales | None = None) -> None:
    """Store k, v (N, KVH, D) at flat ``slots``; an FP8 cache stores them encoded by
    ``kv_scales`` (unit scales when None) with a saturating cast."""
    if is_fp8(cache.dtype):
        k, v = fp8_scales(cache, kv_scales).quantize(k, v, cache.dtype)
    elif cpu.write_kv(cache, slots, k, v):
        return
    flat = cache.view(-1, *cache.shape[2:])  # (num_slots, 2, kvh, d)
    flat[slots] = torch.stack((k, v), dim=1).to(cache.dtype)


# A later chunk of a prompt (keys cached before it) goes to SDPA when its (query, key) pairs
# reach this many: SDPA's per-pair cost is ~0.3x the compiled kernel's on AMX, but the two
# calls, the page gather and the merge cost a fixed ~0.2 ms per layer (SmolLM2, 2 threads:
# 24 tokens after 2,000 break even, 128 after 160; 256 after 2,000 take 0.38x the kernel's).
SDPA_MIN_PAIRS = 40_000


def _sdpa_prefills(meta: AttentionMetadata, head_dim: int) -> torch.Tensor | None:
    """Which prefill chunks SDPA computes rather than the compiled kernels
    (``cpu.SDPA_MIN_TOKENS``: no window, long enough, a head dim the blocked kernels do
    not take; fresh chunks and later chunks of a prompt alike, see
    :func:`sdpa_after_prefix`), as a bool mask over ``meta.prefills``; None when none does."""
    least = cpu.SDPA_MIN_TOKENS
    if least is None or meta.sliding_window is not None or cpu.prefill_tiles(head_dim):
        return None
    pick = [n >= least if not r.ctx_len else n * (r.ctx_len + n // 2) >= SDPA_MIN_PAIRS
            for r in meta.prefills for n in (r.tok_end - r.tok_start,)]
    return torch.tensor(pick) if any(pick) else None


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, kv_scales: KVScales | None = None
                    ) -> torch.Tensor:
    """q (T, H, D), k/v (T, KVH, D) -> (T, H, D). Writes k/v into the cache first.

    ``kv_scales``: the layer's FP8 encoding (an FP8 cache only). Every path reads what the
    cache holds (a chunk's own keys included), so a prefix-cache hit computes what a fresh
    prefill would; FP8 attention runs in float32 on the dequantized values.

    ``meta.image_rows`` (a model whose image tokens attend to each other both ways): those
    rows are computed causally first, then again by :func:`image_rows_attention` (a torch
    path over the cache; only image tokens pay it)."""
    out = _paged_attention(q, k, v, cache, meta, scale, kv_scales)
    if meta.image_rows:
        image_rows_attention(q, cache, meta, scale, out, kv_scales)
    return out


def _paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, kv_scales: KVScales | None
                     ) -> torch.Tensor:
    if kv_scales is None and not is_fp8(cache.dtype):
        if dispatch.use_triton(q.device):  # (CUDA by default)
            from pagefold.ops.attention import triton as attn_triton  # only when chosen

            return attn_triton.paged_attention(q, k, v, cache, meta, scale)
    write_kv(cache, meta.slot_mapping, k, v, kv_scales)
    out = torch.empty_like(q)
    fp8 = is_fp8(cache.dtype)
    if meta.decode_tok.numel():
        rows = None if meta.all_decode else meta.decode_tok
        if fp8 or not cpu.decode_attention(q, rows, cache, meta.decode_tables,
                                                meta.decode_seq_lens, meta.decode_kv_start,
                                                scale, out):
            qd = q if rows is None else q[rows]
            od = decode_torch(qd, cache, meta, scale, kv_scales).to(q.dtype)
            if rows is None:
                out = od
            else:
                out[rows] = od
    prefills = meta.prefills
    to_sdpa = None
    if prefills and q.device.type == "cpu" and q.dtype == torch.bfloat16 and not fp8:
        rows, slots = meta.prefill_pack()
        to_sdpa = _sdpa_prefills(meta, q.shape[2]) if cache.dtype == q.dtype else None
        kernel_rows = rows if to_sdpa is None else rows[~to_sdpa]
        if kernel_rows.shape[0] == 0 or cpu.prefill_attention(
                q, cache, kernel_rows, slots, meta.sliding_window, scale, out):
            if to_sdpa is None:
                return out
            prefills = [r for r, s in zip(prefills, to_sdpa.tolist()) if s]
    prefill_rows(q, k, v, cache, meta, scale, prefills, out, kv_scales,
                 after_prefix=to_sdpa is not None)
    return out
