"""Paged attention against plain softmax attention on contiguous K/V.

One mixed step (decode rows, a fresh prefill, prefill chunks with cached context) runs through
``paged_attention`` for a full-attention group and a sliding-window group at once. Block tables
are scattered at random over a pool that is NaN everywhere except the slots written, and the
sliding group's dead blocks point at the (NaN) null block, so any read of a slot the step should
not see turns the output into NaN.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagefold.core.kv_cache_planner import plan_pagefold
from pagefold.core.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec, cdiv
from pagefold.executor import input_batch
from pagefold.executor.cache_tensors import CacheTensors
from pagefold.executor.input_batch import build_inputs
from pagefold.ops import attention as backend
from pagefold.ops.attention import paged_attention, read_kv, write_kv

BLOCK = 4
WINDOW = 6
HEADS = 4
HEAD_DIM = 16
# (tokens cached before this step, tokens computed this step). Decode rows (1 new token) are
# interleaved with prefill rows, as the scheduler lays them out.
ROWS = [(10, 1), (0, 9), (3, 1), (7, 5), (0, 1), (13, 6), (17, 1), (5, 2)]


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                    window: int | None, scale: float) -> torch.Tensor:
    """Float64 causal softmax attention of queries at positions ``start..`` over all of K/V.

    q (n, H, D); k, v (L, KVH, D) with L = start + n -> (n, H, D).
    """
    n, h, _ = q.shape
    kvh = k.shape[1]
    kk = k.double().repeat_interleave(h // kvh, dim=1)
    vv = v.double().repeat_interleave(h // kvh, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    qpos = torch.arange(start, start + n).unsqueeze(1)
    kpos = torch.arange(k.shape[0]).unsqueeze(0)
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)


def _run_step(kv_heads: int, cache_dtype: torch.dtype, seed: int,
              q_dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    specs = {
        "layers.0": FullAttentionSpec(kv_heads, HEAD_DIM, cache_dtype),
        "layers.1": SlidingWindowSpec(kv_heads, HEAD_DIM, cache_dtype, WINDOW),
    }
    page = BLOCK * 2 * kv_heads * HEAD_DIM * cache_dtype.itemsize
    cfg = plan_pagefold(specs, BLOCK, 64 * page)
    assert cfg.layers_per_group == 1 and cfg.num_blocks == 64
    cache = CacheTensors(cfg, torch.device("cpu"), fill=float("nan"))

    # Both groups live in the one shared tensor: every block id is used once, at random.
    free_ids = list(range(1, cfg.num_blocks))
    rng.shuffle(free_ids)
    tables: list[list[list[int]]] = [[], []]
    for ctx, n in ROWS:
        nblk = cdiv(ctx + n, BLOCK)
        tables[0].append([free_ids.pop() for _ in range(nblk)])
        dead = max(0, ctx - WINDOW + 1) // BLOCK  # what SlidingWindowManager has released
        tables[1].append([0] * dead + [free_ids.pop() for _ in range(nblk - dead)])

    seqs = []
    for ctx, n in ROWS:
        length = ctx + n
        seqs.append({
            name: (torch.randn(length, HEADS, HEAD_DIM, generator=gen).to(q_dtype),
                   torch.randn(length, kv_heads, HEAD_DIM, generator=gen).to(q_dtype),
                   torch.randn(length, kv_heads, HEAD_DIM, generator=gen).to(q_dtype))
            for name in specs
        })
    # Earlier steps' K/V: only the positions whose blocks the request still holds.
    for gi, name in enumerate(specs):
        layer_cache = cache.attn[name]
        for (ctx, _), seq, table in zip(ROWS, seqs, tables[gi]):
            pos = torch.tensor([p for p in range(ctx) if table[p // BLOCK] != 0], dtype=torch.long)
            if len(pos):
                slots = torch.tensor(table)[pos // BLOCK] * BLOCK + pos % BLOCK
                write_kv(layer_cache, slots, seq[name][1][pos], seq[name][2][pos])

    starts = [ctx for ctx, _ in ROWS]
    counts = [n for _, n in ROWS]
    inp = build_inputs(cfg, [[7] * n for n in counts], starts, counts,
                       [c + n for c, n in ROWS], tables)
    scale = HEAD_DIM**-0.5
    results = {}
    for gi, name in enumerate(specs):
        q = torch.cat([s[name][0][c:] for s, c in zip(seqs, starts)])
        k = torch.cat([s[name][1][c:] for s, c in zip(seqs, starts)])
        v = torch.cat([s[name][2][c:] for s, c in zip(seqs, starts)])
        out = paged_attention(q, k, v, cache.attn[name], inp.attn_meta[gi], scale)
        window = WINDOW if gi == 1 else None
        refs = []
        for (ctx, _), s in zip(ROWS, seqs):
            sq, sk, sv = s[name]
            # The reference sees K/V as the cache stores them.
            sk, sv = sk.to(cache_dtype).float(), sv.to(cache_dtype).float()
            refs.append(dense_reference(sq[ctx:].float(), sk, sv, ctx, window, scale))
        results[name] = (out, torch.cat(refs), k, v, inp.attn_meta[gi].slot_mapping,
                         [sq[name] for sq in seqs])
    return cache, results


@pytest.mark.parametrize(
    "kv_heads,cache_dtype,q_dtype,tol",
    [(2, torch.float32, torch.float32, 1e-5), (1, torch.float32, torch.float32, 1e-5),
     (2, torch.bfloat16, torch.float32, 2e-5), (2, torch.bfloat16, torch.bfloat16, 2e-2),
     (1, torch.bfloat16, torch.bfloat16, 2e-2)],
    ids=["gqa-f32", "mqa-f32", "gqa-bf16cache", "gqa-bf16", "mqa-bf16"],
)
def test_paged_attention_matches_dense(kv_heads: int, cache_dtype: torch.dtype,
                                       q_dtype: torch.dtype, tol: float):
    """bf16 queries take the compiled prefill and decode kernels where the CPU has them."""
    cache, results = _run_step(kv_heads, cache_dtype, seed=kv_heads * 10 + cache_dtype.itemsize,
                               q_dtype=q_dtype)
    for name, (out, ref, k, v, slots, _) in results.items():
        assert not torch.isnan(out).any(), f"{name}: output read an unwritten (NaN) slot"
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol, msg=name)
        # This step's K/V landed in the slots the metadata names.
        stored = read_kv(cache.attn[name], slots, torch.float32)
        torch.testing.assert_close(stored[:, 0], k.to(cache_dtype).float())
        torch.testing.assert_close(stored[:, 1], v.to(cache_dtype).float())


def test_window_changes_long_rows():
    """The window is in effect: rows past it differ from no-window attention, others do not."""
    _, results = _run_step(2, torch.float32, seed=3)
    out, _, _, _, _, seqs = results["layers.1"]
    offset = 0
    for (ctx, n), (sq, sk, sv) in zip(ROWS, seqs):
        got = out[offset : offset + n].double()
        offset += n
        no_window = dense_reference(sq[ctx:], sk, sv, ctx, None, HEAD_DIM**-0.5)
        past = torch.arange(ctx, ctx + n) >= WINDOW  # rows with a key outside their window
        torch.testing.assert_close(got[~past], no_window[~past], atol=1e-5, rtol=1e-5)
        if past.any():
            assert (got[past] - no_window[past]).abs().amax() > 1e-3


def test_decode_metadata_skips_dead_blocks():
    """Decode rows read only blocks that hold a key in their window (never the null block)."""
    specs = {"layers.0": SlidingWindowSpec(2, HEAD_DIM, torch.float32, WINDOW)}
    cfg = plan_pagefold(specs, BLOCK, 32 * BLOCK * 2 * 2 * HEAD_DIM * 4)
    ctx = 17  # keys 12..17 are in the window: blocks 3 and 4
    table = [0, 0, 0, 5, 9]
    inp = build_inputs(cfg, [[1]], [ctx], [1], [ctx + 1], [[table]])
    meta = inp.attn_meta[0]
    assert meta.decode_blocks.tolist() == [5, 9]
    assert 0 not in meta.decode_blocks.tolist()
    assert meta.slot_mapping.tolist() == [9 * BLOCK + ctx % BLOCK]


def test_fresh_prefills_routed_to_sdpa(monkeypatch):
    """With ``SDPA_MIN_TOKENS`` set (AMX CPUs), fresh bf16 chunks that long and later chunks
    with ``SDPA_MIN_PAIRS`` (query, key) pairs go to SDPA (a later chunk as two calls merged by
    their log-sum-exps) and only the others reach the compiled kernel; the step's output still
    matches the reference."""
    from pagefold.ops.attention import cpu as attn_cpu

    seen = []
    kernel = attn_cpu.prefill_attention

    def spy(q, cache, rows, *args):
        seen.append(rows[:, 1:3].tolist())  # (q_len, ctx_len) per row handed to the kernel
        return kernel(q, cache, rows, *args)

    monkeypatch.setattr(attn_cpu, "prefill_attention", spy)
    monkeypatch.setattr(attn_cpu, "SDPA_MIN_TOKENS", 6)
    monkeypatch.setattr(attn_cpu, "prefill_tiles", lambda head_dim: False)  # a dim it declines
    # Later chunks by their (query, key) pairs: 6 x (13 + 3) = 96 in, 5 x (7 + 2) = 45 out.
    monkeypatch.setattr(backend, "SDPA_MIN_PAIRS", 90)
    monkeypatch.setattr(input_batch, "SHORT_CHUNK_AS_DECODE", 1)  # chunks > 1 are prefills
    _, results = _run_step(2, torch.bfloat16, seed=22, q_dtype=torch.bfloat16)
    for name, (out, ref, *_rest) in results.items():
        assert not torch.isnan(out).any(), name
        torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2, msg=name)
    # The full-attention group: the fresh 9 and the 6 after 13 are SDPA's;
    # the sliding group keeps every chunk on the kernel (its window is not SDPA's causal mask).
    assert seen[0] == [[5, 7], [2, 5]]
    assert seen[1] == [[9, 0], [5, 7], [6, 13], [2, 5]]


def test_tile_kernel_takes_every_prefill(monkeypatch):
    """Where the AMX tile kernel takes the head dim, no chunk goes to SDPA whatever
    ``SDPA_MIN_TOKENS`` says: every row reaches the compiled kernels, and the step still
    matches the reference."""
    from pagefold.ops.attention import cpu as attn_cpu

    seen = []
    kernel = attn_cpu.prefill_attention

    def spy(q, cache, rows, *args):
        seen.append(rows[:, 1:3].tolist())
        return kernel(q, cache, rows, *args)

    monkeypatch.setattr(attn_cpu, "prefill_attention", spy)
    monkeypatch.setattr(attn_cpu, "SDPA_MIN_TOKENS", 6)
    monkeypatch.setattr(attn_cpu, "prefill_tiles", lambda head_dim: True)
    monkeypatch.setattr(backend, "SDPA_MIN_PAIRS", 90)
    monkeypatch.setattr(input_batch, "SHORT_CHUNK_AS_DECODE", 1)
    _, results = _run_step(2, torch.bfloat16, seed=22, q_dtype=torch.bfloat16)
    for name, (out, ref, *_rest) in results.items():
        assert not torch.isnan(out).any(), name
        torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2, msg=name)
    assert seen[1] == [[9, 0], [5, 7], [6, 13], [2, 5]]
