"""The compiled CPU paged attention (``csrc/attention.cpp``, ``prefill.cpp``,
``prefill_blocked.cpp``) through ctypes: decode rows, prefill chunks and the K/V write. Every
wrapper returns False (nothing written) when the kernel does not take the inputs; the caller
then takes its torch path."""

from __future__ import annotations

import os

import torch

from pagefold.csrc.cpu_ops import DTYPE_CODE, kernels, ptr


def decode_attention(q: torch.Tensor, rows: torch.Tensor | None, cache: torch.Tensor,
                     tables: torch.Tensor, seq_lens: torch.Tensor,
                     kv_starts: torch.Tensor | None, scale: float, out: torch.Tensor) -> bool:
    """Single-token attention over paged K/V, read in place (no gather).

    q, out: (T, H, D) with heads and dims contiguous; ``rows`` (B,) int64 picks the decode
    rows of q/out (``None``: all T rows). tables (B, W) int64 block ids; seq_lens (B,) keys per
    row (the new token included, already written); kv_starts (B,) first key position or None.
    cache (num_blocks, block_size, 2, KVH, D). Writes out[rows]; returns False (nothing
    written) when the kernel does not handle these inputs.
    """
    lib = kernels()
    if lib is None or q.device.type != "cpu":
        return False
    code = DTYPE_CODE.get(q.dtype)
    _, h, d = q.shape
    _, bs, _, kvh, _ = cache.shape
    if (code is None or cache.dtype != q.dtype or out.dtype != q.dtype or h % kvh
            or d > lib.pf_max_head_dim() or h // kvh > lib.pf_max_group()
            or bs > lib.pf_max_block() or not cache.is_contiguous()
            or q.stride(2) != 1 or q.stride(1) != d or out.stride(2) != 1
            or out.stride(1) != d):
        return False
    if rows is not None:
        rows = rows.contiguous()
    tables = tables.contiguous()
    seq_lens = seq_lens.contiguous()
    if kv_starts is not None:
        kv_starts = kv_starts.contiguous()
    rc = lib.pf_decode_attention(
        code, ptr(q), q.stride(0), ptr(rows) if rows is not None else None, ptr(cache),
        ptr(tables), tables.stride(0), ptr(seq_lens),
        ptr(kv_starts) if kv_starts is not None else None, ptr(out), out.stride(0),
        seq_lens.shape[0], h, kvh, d, bs, float(scale), torch.get_num_threads())
    return rc == 0


PREFILL_KERNELS = ("auto", "amx", "blocked", "rows")


def prefill_attention(q: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor,
                      slots: torch.Tensor, window: int | None, scale: float,
                      out: torch.Tensor, kernel: str = "auto") -> bool:
    """Causal attention of prefill chunks over the paged cache (their own K/V already
    written), bf16 only. ``kernel``: ``"auto"`` takes the first that handles the shapes of
    ``"amx"`` (``prefill_blocked.cpp`` on AMX tiles: CPUs with AMX), ``"blocked"`` (the same
    on AVX512-BF16 dot products) and ``"rows"`` (``prefill.cpp``, one query row at a time;
    the blocked kernels send rows of fewer than 8 query heads x tokens to it themselves);
    naming one runs only that one (tests, benchmarks). The blocked kernels take head dims
    that are a multiple of 32 up to 256. ``rows`` (R, 5) int64: per chunk ``tok_start, q_len,
    ctx_len, kv_start, slot_off``; key position ``p`` of a chunk is at flat slot
    ``slots[slot_off + p - kv_start]``. q, out (T, H, D) with heads and dims contiguous.
    Writes the chunks' rows of ``out``; False (nothing written) when not handled."""
    if kernel not in PREFILL_KERNELS:
        raise ValueError(f"kernel must be one of {PREFILL_KERNELS}, got {kernel!r}")
    lib = kernels()
    if lib is None or q.device.type != "cpu" or q.dtype != torch.bfloat16:
        return False
    _, h, d = q.shape
    kvh = cache.shape[3]
    if (cache.dtype != torch.bfloat16 or out.dtype != torch.bfloat16 or h % kvh
            or not cache.is_contiguous() or q.stride(2) != 1 or q.stride(1) != d
            or out.stride(2) != 1 or out.stride(1) != d or rows.dtype != torch.int64
            or slots.dtype != torch.int64):
        return False
    rows, slots = rows.contiguous(), slots.contiguous()
    args = (ptr(q), q.stride(0), ptr(cache), ptr(slots), ptr(rows), rows.shape[0],
            ptr(out), out.stride(0), h, kvh, d, int(window or 0), float(scale),
            torch.get_num_threads())
    fns = {"amx": lib.pf_prefill_attention_amx, "blocked": lib.pf_prefill_attention_blocked,
           "rows": lib.pf_prefill_attention}
    order = fns.values() if kernel == "auto" else (fns[kernel],)
    return any(fn(*args) == 0 for fn in order)


def prefill_tiles(head_dim: int) -> bool:
    """A blocked kernel (AMX tiles or AVX512-BF16 dot products) computes bf16 prefill attention
    of this head dim: a multiple of 32 up to 256 on a build with AVX512-BF16."""
    lib = kernels()
    return (lib is not None and head_dim % 32 == 0 and 0 < head_dim <= 256
            and bool(lib.pf_prefill_blocked_ready()))


def _cpu_has_amx() -> bool:
    fn = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(fn is not None and fn())


def _sdpa_min_tokens() -> int | None:
    flag = os.environ.get("PAGEFOLD_SDPA_MIN_TOKENS")
    if flag is not None:
        return int(flag) if int(flag) > 0 else None
    return 64 if _cpu_has_amx() else None


# Fresh bf16 prefill chunks (nothing cached before them, no sliding window) of at least this
# many tokens go to torch's SDPA instead of :func:`prefill_attention` (None: never) where the
# blocked kernels do not take the head dim (:func:`prefill_tiles`). Where the CPU has AMX,
# ATen's flash attention runs its bf16 products on AMX tiles: one thread, 9 heads over 3 kv
# heads of 64, SDPA per chunk takes 0.37x the row kernel's time at 256 tokens and 0.19x at
# 2048, but 1.6-3x it at 16-32 tokens (its fixed cost per call); the tile kernel takes
# 0.5-0.75x SDPA's. Without AMX the row kernel stays for those dims (1.2-3x faster than SDPA on
# a Zen 5, ``benchmarks/prefill_attention.py``).
# ``PAGEFOLD_SDPA_MIN_TOKENS`` overrides (0: never).
SDPA_MIN_TOKENS: int | None = _sdpa_min_tokens()


def write_kv(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Store k, v (N, KVH, D) at flat ``slots`` (N,) of cache; False when not handled."""
    lib = kernels()
    if lib is None or k.device.type != "cpu":
        return False
    code = DTYPE_CODE.get(cache.dtype)
    n, kvh, d = k.shape
    if (code is None or k.dtype != cache.dtype or v.dtype != cache.dtype
            or not cache.is_contiguous() or slots.dtype != torch.int64
            or any(x.stride(2) != 1 or x.stride(1) != d for x in (k, v))):
        return False
    slots = slots.contiguous()
    rc = lib.pf_write_kv(code, ptr(k), ptr(v), k.stride(0), v.stride(0), ptr(slots),
                         ptr(cache), n, kvh, d)
    return rc == 0
