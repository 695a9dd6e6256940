"""Paged multi-head latent attention: pages hold one latent row per token, not K and V.

Cache per layer: ``(num_blocks, block_size, latent_dim)`` (:class:`~pagefold.core.kv_cache_spec.
MLASpec`); slots and block tables are those of any full-attention group. Each step writes the
new tokens' latents, then every row (decode or prefill chunk) reads the latents of its keys by
slot and expands them with ``expand(latents (N, latent_dim)) -> (k (N, H, Dqk), v (N, H, Dv))``
(the layer's up-projection), so K/V for the context are never stored. Causal softmax attention
in float32 follows. Correctness-first torch path (a per-row loop).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagefold.ops.attention import AttentionMetadata

__all__ = ["paged_mla_attention"]


def _attend(q, k, v, qpos, kpos, scale):
    s = torch.einsum("lhd,nhd->hln", q.float(), k.float()) * scale
    s = s.masked_fill(~(kpos[None, :] <= qpos[:, None])[None], float("-inf"))
    return torch.einsum("hln,nhd->lhd", torch.softmax(s, dim=-1), v.float())


def paged_mla_attention(q: torch.Tensor, latent: torch.Tensor, cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float,
                        expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
                        ) -> torch.Tensor:
    """q (T, H, Dqk), latent (T, latent_dim) -> (T, H, Dv) in q's dtype."""
    if meta.sliding_window is not None:
        raise ValueError("latent attention has no sliding-window form")
    flat = cache.view(-1, cache.shape[-1])
    flat[meta.slot_mapping] = latent.to(cache.dtype)
    dev, bs = q.device, meta.block_size
    rows: list[tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    if meta.decode_tok.numel():
        for i, (tok, n) in enumerate(zip(meta.decode_tok.tolist(),
                                         meta.decode_seq_lens.tolist(), strict=True)):
            kpos = torch.arange(n, device=dev)
            slots = meta.decode_tables[i].to(dev)[kpos // bs] * bs + kpos % bs
            rows.append((slice(tok, tok + 1), slots, torch.tensor([n - 1], device=dev), kpos))
    for r in meta.prefills:
        n = r.ctx_len + (r.tok_end - r.tok_start)
        qpos = torch.arange(r.ctx_len, n, device=dev)
        rows.append((slice(r.tok_start, r.tok_end), r.kv_slots, qpos,
                     torch.arange(r.kv_start, n, device=dev)))
    out = None
    for sl, slots, qpos, kpos in rows:
        k, v = expand(flat[slots].to(q.dtype))
        o = _attend(q[sl], k, v, qpos, kpos, scale)
        if out is None:
            out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=dev)
        out[sl] = o.to(q.dtype)
    if out is None:  # no rows at all (an empty batch)
        k, v = expand(latent[:0])
        out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=dev)
    return out
