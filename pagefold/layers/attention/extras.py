"""Paged attention with per-head sinks, logit soft-capping and/or chunked local attention
(gpt-oss, soft-capped Gemma, Llama-4's local layers).

Same cache layout, metadata and call shape as :func:`pagefold.ops.attention.
paged_attention`; the scores are computed explicitly (float32), so two extras the fast paths do
not have can enter the softmax:

* ``softcap`` c: ``s = c * tanh(s / c)`` on the scaled scores, before the causal/window mask;
* ``sinks`` (H,): one extra logit per head joins each softmax and is dropped after it, so a
  query can put weight on "nothing": ``p_j = exp(s_j) / (sum_k exp(s_k) + exp(sink_h))``;
* ``chunk`` C: a query at ``p`` sees only keys of its own chunk, ``[p - p % C, p]`` (the
  metadata of a ``ChunkedLocalAttentionSpec`` group starts every row at its first query's
  chunk, so a prefill row crossing a chunk start is masked here).

Every row (decode or prefill chunk) reads its keys from the pages by slot, after this step's K/V
are written, so cached and new keys go through one formula. Rows are grouped by request; this
is a correctness-first torch path (the per-row loop is fine for CPU serving at small batch).
"""

from __future__ import annotations

import torch

from pagefold.ops.attention import AttentionMetadata, read_kv, write_kv

__all__ = ["paged_attention_extras"]


def _attend(q: torch.Tensor, kv: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor,
            window: int | None, scale: float, sinks: torch.Tensor | None,
            softcap: float | None, chunk: int | None = None) -> torch.Tensor:
    """q (L, H, D), kv (N, 2, KVH, D) -> (L, H, D) float32."""
    h, kvh = q.shape[1], kv.shape[2]
    keys = kv[:, 0].float().repeat_interleave(h // kvh, dim=1)  # (N, H, D)
    vals = kv[:, 1].float().repeat_interleave(h // kvh, dim=1)
    s = torch.einsum("lhd,nhd->hln", q.float(), keys) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    mask = kpos[None, :] <= qpos[:, None]
    if window is not None:
        mask &= kpos[None, :] > qpos[:, None] - window
    if chunk is not None:
        mask &= kpos[None, :] >= qpos[:, None] - qpos[:, None] % chunk
    s = s.masked_fill(~mask[None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(h, 1, 1).expand(h, s.shape[1], 1)
        s = torch.cat((s, sink), dim=-1)
    p = torch.softmax(s, dim=-1)
    if sinks is not None:
        p = p[..., :-1]
    return torch.einsum("hln,nhd->lhd", p, vals)


def paged_attention_extras(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cache: torch.Tensor, meta: AttentionMetadata, scale: float, *,
                           sinks: torch.Tensor | None = None,
                           softcap: float | None = None,
                           chunk: int | None = None) -> torch.Tensor:
    """q (T, H, D), k/v (T, KVH, D) -> (T, H, D) in q's dtype. Writes k/v into the cache."""
    if meta.image_rows:
        raise ValueError("image tokens attending both ways are not supported with attention "
                         "sinks, soft caps or chunked local attention")
    write_kv(cache, meta.slot_mapping, k, v)
    out = torch.empty_like(q)
    dev, bs, window = q.device, meta.block_size, meta.sliding_window
    if meta.decode_tok.numel():
        toks = meta.decode_tok.tolist()
        lens = meta.decode_seq_lens.tolist()
        starts = (meta.decode_kv_start.tolist() if meta.decode_kv_start is not None
                  else [0] * len(toks))
        for i, (tok, n, lo) in enumerate(zip(toks, lens, starts, strict=True)):
            kpos = torch.arange(lo, n, device=dev)
            slots = meta.decode_tables[i].to(dev)[kpos // bs] * bs + kpos % bs
            kv = read_kv(cache, slots, torch.float32)
            qpos = torch.tensor([n - 1], device=dev)
            out[tok] = _attend(q[tok : tok + 1], kv, qpos, kpos, window, scale, sinks,
                               softcap, chunk)[0].to(q.dtype)
    for row in meta.prefills:
        q_len = row.tok_end - row.tok_start
        kv = read_kv(cache, row.kv_slots, torch.float32)
        kpos = torch.arange(row.kv_start, row.ctx_len + q_len, device=dev)
        qpos = torch.arange(row.ctx_len, row.ctx_len + q_len, device=dev)
        o = _attend(q[row.tok_start : row.tok_end], kv, qpos, kpos, window, scale, sinks,
                    softcap, chunk)
        out[row.tok_start : row.tok_end] = o.to(q.dtype)
    return out
