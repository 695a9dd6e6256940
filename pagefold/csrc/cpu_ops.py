"""Compiled CPU kernels, built on first use (:mod:`pagefold.csrc.build`) and called through
ctypes.

``attention.cpp`` (paged decode attention, the K/V write), ``prefill.cpp`` (prefill
attention over the paged cache, one query row at a time, AVX512-BF16), ``prefill_blocked.cpp``
(the same blocked: 32 query lanes x 32-key blocks on AMX tiles or AVX512-BF16 dot products),
``layers.cpp`` (RMSNorm with the residual add, q/k norm + RoPE, SiLU-and-mul, the gated
RMSNorm of GDN outputs, the bf16 small-M products), ``gemv_amx.cpp`` (the small-M products on
AMX), ``gdn.cpp`` (the Gated DeltaNet layer on paged states), ``mamba2.cpp`` (the Mamba-2
decode step), ``ssd.cpp`` (the chunked Mamba-2 SSD scan of prefills), ``conv.cpp`` (the
varlen causal conv of prefills) and ``gated_norm.cpp`` (Mamba-2's gated RMSNorm), with
``common.h``, use no torch or Python headers: one ``g++`` call builds them in a few seconds.

Fallback: when the build fails (no compiler) or ``PAGEFOLD_CPU_KERNELS=0``, :func:`kernels`
returns ``None`` and callers take their pure-torch path; the reason is logged once. The
kernels link the OpenMP runtime by soname, so they share the one torch already loaded.

Every wrapper returns ``False`` / ``None`` (and writes nothing) when the inputs fall outside
what the kernel handles (another device or dtype, unusual strides or sizes), so the caller can
always fall back to torch. Tensors are passed by pointer: the wrappers check dtypes and
strides before every call.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import torch

from pagefold.csrc import build, gemm

logger = logging.getLogger("pagefold")

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


_ENABLED = os.environ.get("PAGEFOLD_CPU_KERNELS", "1") != "0"


def enabled() -> bool:
    """False when ``PAGEFOLD_CPU_KERNELS=0`` at import, or after :func:`set_enabled` (False)."""
    return _ENABLED


def set_enabled(on: bool) -> None:
    """Switch the kernels on or off for this process (tests compare both paths)."""
    global _ENABLED
    _ENABLED = bool(on)


def kernels() -> ctypes.CDLL | None:
    """The loaded library, building it on the first call; ``None`` means use torch."""
    global _lib, _tried
    if not _ENABLED:
        return None
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            try:
                lib = build.load()
                _choose_gemv(lib)
                _lib = lib
            except Exception as e:  # noqa: BLE001 - any failure means the torch fallback
                logger.warning("pagefold CPU kernels unavailable, using the torch path: %s", e)
            _tried = True
    return _lib


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


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
    code = _DTYPE_CODE.get(q.dtype)
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
        code, _ptr(q), q.stride(0), _ptr(rows) if rows is not None else None, _ptr(cache),
        _ptr(tables), tables.stride(0), _ptr(seq_lens),
        _ptr(kv_starts) if kv_starts is not None else None, _ptr(out), out.stride(0),
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
    args = (_ptr(q), q.stride(0), _ptr(cache), _ptr(slots), _ptr(rows), rows.shape[0],
            _ptr(out), out.stride(0), h, kvh, d, int(window or 0), float(scale),
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
    code = _DTYPE_CODE.get(cache.dtype)
    n, kvh, d = k.shape
    if (code is None or k.dtype != cache.dtype or v.dtype != cache.dtype
            or not cache.is_contiguous() or slots.dtype != torch.int64
            or any(x.stride(2) != 1 or x.stride(1) != d for x in (k, v))):
        return False
    slots = slots.contiguous()
    rc = lib.pf_write_kv(code, _ptr(k), _ptr(v), k.stride(0), v.stride(0), _ptr(slots),
                         _ptr(cache), n, kvh, d)
    return rc == 0


def _rows_ok(t: torch.Tensor) -> bool:
    """2-D with contiguous rows (any row stride)."""
    return t.dim() == 2 and t.stride(1) == 1


def _usable(*ts: torch.Tensor) -> int | None:
    """The dtype code when every tensor is on the CPU with one supported dtype, else None."""
    dt = ts[0].dtype
    if any(t.device.type != "cpu" or t.dtype != dt for t in ts):
        return None
    return _DTYPE_CODE.get(dt)


# rms_norm's mode for a weight multiply in float32 before the cast (Nemotron-H's norm).
NORM_FLOAT_WEIGHT = 2


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool | int,
             residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """RMSNorm over the last dim (see ``pagefold.layers.norm``); with ``residual``,
    ``residual += x`` (rounded to the dtype, in place) is what gets normalised. Returns the
    normalised tensor, or None when not handled (nothing written). ``zero_centered`` may be
    :data:`NORM_FLOAT_WEIGHT` instead: ``(x / rms(x) * weight)`` rounded once."""
    lib = kernels()
    if lib is None or x.numel() == 0:
        return None
    d = x.shape[-1]
    x2 = x.reshape(-1, d) if x.dim() != 2 else x
    if residual is not None:
        if residual.shape != x.shape:
            return None
        r2 = residual.view(-1, d) if residual.dim() != 2 else residual
    else:
        r2 = None
    code = _usable(x2, weight) if r2 is None else _usable(x2, weight, r2)
    if (code is None or not _rows_ok(x2) or (r2 is not None and not _rows_ok(r2))
            or not weight.is_contiguous() or weight.numel() != d):
        return None
    out = torch.empty(x2.shape, dtype=x.dtype)
    rc = lib.pf_rms_norm(code, _ptr(x2), x2.stride(0),
                         _ptr(r2) if r2 is not None else None,
                         r2.stride(0) if r2 is not None else 0, _ptr(weight), _ptr(out), d,
                         x2.shape[0], d, float(eps), int(zero_centered), torch.get_num_threads())
    return out.view(x.shape) if rc == 0 else None


def qk_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, *, num_heads: int, num_kv_heads: int, head_dim: int,
                 q_off: int, q_head_stride: int, k_off: int, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, eps: float, zero_centered: bool
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-head q/k RMSNorm (when weights are given) then neox RoPE on the first
    ``cos.shape[1]`` channels, read from the fused projection ``qkv`` (T, width): query head
    ``h`` at column ``q_off + h * q_head_stride``, kv head ``j`` at ``k_off + j * head_dim``.
    ``cos``/``sin``: float32 (max_positions, rotary_dim) tables. Returns fresh contiguous
    ``q (T, H, D)``, ``k (T, KVH, D)``, or None when not handled."""
    lib = kernels()
    if lib is None:
        return None
    ws = [w for w in (q_weight, k_weight) if w is not None]
    code = _usable(qkv, *ws)
    if (code is None or not _rows_ok(qkv) or positions.dtype != torch.int64
            or positions.device.type != "cpu" or cos.dtype != torch.float32
            or sin.dtype != torch.float32 or not cos.is_contiguous() or not sin.is_contiguous()
            or (q_weight is None) != (k_weight is None)
            or any(not w.is_contiguous() or w.numel() != head_dim for w in ws)):
        return None
    t = qkv.shape[0]
    positions = positions.contiguous()
    q = torch.empty((t, num_heads, head_dim), dtype=qkv.dtype)
    k = torch.empty((t, num_kv_heads, head_dim), dtype=qkv.dtype)
    rc = lib.pf_qk_norm_rope(
        code, _ptr(qkv), qkv.stride(0), q_off, q_head_stride, k_off, _ptr(positions),
        _ptr(cos), _ptr(sin), cos.shape[1],
        _ptr(q_weight) if q_weight is not None else None,
        _ptr(k_weight) if k_weight is not None else None, float(eps), int(zero_centered),
        _ptr(q), _ptr(k), t, num_heads, num_kv_heads, head_dim, torch.get_num_threads())
    return (q, k) if rc == 0 else None


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` for ``gate_up`` (T, 2I) = [gate | up], rounded like the torch ops
    (silu's result, then the product). Returns (T, I), or None when not handled."""
    lib = kernels()
    if lib is None:
        return None
    code = _usable(gate_up)
    if code is None or not _rows_ok(gate_up) or gate_up.shape[1] % 2:
        return None
    n, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n, i), dtype=gate_up.dtype)
    rc = lib.pf_silu_mul(code, _ptr(gate_up), gate_up.stride(0), _ptr(out), n, i,
                         torch.get_num_threads())
    return out if rc == 0 else None


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor | None:
    """``weight * rmsnorm(x) * silu(gate)`` per (token, head) row of ``x``/``gate`` (N, H, D),
    each with contiguous rows (any token and head strides), rounded as
    ``pagefold.models.qwen3_5.RMSNormGated``. Returns (N, H, D), or None when not handled."""
    lib = kernels()
    if lib is None or x.dim() != 3 or gate.shape != x.shape or x.numel() == 0:
        return None
    code = _usable(x, gate, weight)
    if (code is None or x.stride(2) != 1 or gate.stride(2) != 1 or not weight.is_contiguous()
            or weight.numel() != x.shape[2]):
        return None
    n, h, d = x.shape
    out = torch.empty((n, h, d), dtype=x.dtype)
    rc = lib.pf_rms_norm_gated(code, _ptr(x), x.stride(0), x.stride(1), _ptr(gate),
                               gate.stride(0), gate.stride(1), _ptr(weight), _ptr(out), n, h, d,
                               float(eps), torch.get_num_threads())
    return out if rc == 0 else None


# State spec -> (conv component, ssm component, offsets by name): fixed per spec.
_GDN_LAYOUT: dict = {}


def page_write(raw: torch.Tensor, page_ids: torch.Tensor, off: int,
               data: torch.Tensor | None, nbytes: int, stream: bool = False) -> bool:
    """Bytes ``[off, off + nbytes)`` of the states over ``page_ids`` (N, pages) of ``raw``
    (num_blocks, page_bytes) uint8 := the rows of ``data`` (N, nbytes) uint8, or zeros
    (``data`` None); ``stream``: non-temporal stores. False (nothing written) when not
    handled: kernels off, not on the CPU, non-contiguous tensors."""
    lib = kernels()
    if (lib is None or raw.device.type != "cpu" or not raw.is_contiguous()
            or (data is not None and (data.dtype != torch.uint8 or data.stride(1) != 1
                                      or tuple(data.shape) != (page_ids.shape[0], nbytes)))):
        return False
    ids = page_ids.to(torch.int64).contiguous()
    n = ids.shape[0]
    rc = lib.pf_page_write(
        _ptr(raw), raw.shape[1], _ptr(ids), n, ids.shape[1], off,
        _ptr(data) if data is not None else None, data.stride(0) if data is not None else 0,
        nbytes, int(stream), torch.get_num_threads())
    return rc == 0


def _state_kernel(view) -> tuple | None:
    """(library, conv component, ssm component, {name: byte offset}) for a kernel on a conv +
    SSM state (the layout found once per spec); None without the kernels or for specs without
    both components."""
    lib = kernels()
    if lib is None:
        return None
    layout = _GDN_LAYOUT.get(view.spec)
    if layout is None:
        spec = view.spec
        try:
            layout = (spec.component("conv"), spec.component("ssm"),
                      dict(zip((c.name for c in spec.components), spec.offsets)))
        except KeyError:
            return None
        _GDN_LAYOUT[spec] = layout
    return (lib, *layout)


def _fresh_flags(has_initial_state: torch.Tensor) -> torch.Tensor | None:
    """(N,) uint8 of the sequences starting fresh (their pages read as zeros), None if none."""
    if bool(has_initial_state.all()):
        return None
    return (~has_initial_state).to(torch.uint8).contiguous()


def _neg_exp(a_log: torch.Tensor) -> torch.Tensor:
    """``-exp(A_log)`` in float32, computed once per parameter and kept on it (recomputed
    after an in-place change, seen by the tensor's version counter)."""
    try:
        version = a_log._version
    except RuntimeError:  # an inference-mode tensor has no version counter: no caching
        return (-a_log.float().exp()).contiguous()
    hit = getattr(a_log, "_pf_neg_exp", None)
    if hit is not None and hit[0] == version:
        return hit[1]
    val = (-a_log.detach().float().exp()).contiguous()
    a_log._pf_neg_exp = (version, val)
    return val



# Public names for the compiled decode step (``layers.decode_native``), which passes the same
# per-step values the state kernels below take.
def state_layout(view) -> tuple | None:
    """(library, conv component, ssm component, {name: byte offset}) of a conv + SSM state
    view, as the state kernels read it; None without the kernels or both components."""
    return _state_kernel(view)


def fresh_flags(has_initial_state: torch.Tensor) -> torch.Tensor | None:
    """(N,) uint8 of the sequences starting fresh, None if none (as the state kernels take)."""
    return _fresh_flags(has_initial_state)


def neg_exp(a_log: torch.Tensor) -> torch.Tensor:
    """``-exp(A_log)`` in float32, cached on the parameter (as the state kernels take it)."""
    return _neg_exp(a_log)

def gdn(view, page_ids: torch.Tensor, has_initial_state: torch.Tensor,
        cu_seqlens: torch.Tensor, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
        conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *,
        num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
        scale: float | None = None,
        capture: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    """A Gated DeltaNet layer's conv and delta rule over a flat varlen batch (prefill chunks
    and decode tokens alike), token-recurrent per sequence, reading each sequence's conv and
    SSM states from their pages once and writing them back once (no gather, no scatter).

    ``view``: the layer's :class:`~pagefold.executor.cache_tensors.StateView`; ``page_ids``
    (N, pages_per_state); ``cu_seqlens`` (N+1,); ``mixed`` (T, conv_dim) the conv input;
    ``a``, ``b`` (T, Hv); ``conv_weight`` (conv_dim, K). Equals ``causal_conv1d_*`` +
    ``gdn_recurrent`` / ``gdn_chunked`` (L2 norm on q/k, ``scale`` default ``Dk ** -0.5``) +
    storing both states, up to float32 rounding. Returns ``o`` (T, Hv, Dv) in mixed's dtype,
    or None when not handled (nothing written).

    ``capture=(after (M,), pages (M, pages_per_state))``: the states right after flat token
    ``after[m]`` also go to ``pages[m]`` (a prefix-cache checkpoint inside the chunk), the
    same bytes a call ending after that token leaves in the sequence's own pages.
    """
    found = _state_kernel(view)
    if found is None:
        return None
    lib, conv, ssm, offs = found
    t, c = mixed.shape
    k = conv_weight.shape[1]
    pb = view.page_bytes
    ssm_code = _DTYPE_CODE.get(ssm.dtype)
    code = _usable(mixed, a, b, conv_weight, dt_bias)
    if (code is None or ssm_code is None or conv.dtype != mixed.dtype
            or conv.shape != (c, k - 1) or ssm.shape != (num_v_heads, head_k_dim, head_v_dim)
            or 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim != c or k < 2
            or not view.raw.is_contiguous() or not _rows_ok(mixed)
            or a.stride(1) != 1 or b.stride(1) != 1 or a.stride(0) != b.stride(0)
            or not conv_weight.is_contiguous() or not dt_bias.is_contiguous()
            or cu_seqlens.device.type != "cpu"):
        return None
    pages = page_ids.contiguous()
    cu = cu_seqlens.to(torch.int64).contiguous()
    fresh = _fresh_flags(has_initial_state)
    neg_exp_alog = _neg_exp(A_log)
    out = torch.empty((t, num_v_heads, head_v_dim), dtype=mixed.dtype)
    cap_cu = cap_off = cap_pages = None
    if capture is not None:
        after, cpages = capture
        after, perm = after.to(torch.int64).sort()  # grouped by sequence, offsets ascending
        cap_pages = cpages.to(torch.int64)[perm].contiguous()
        cap_cu = torch.searchsorted(after, cu).contiguous()
        seq = torch.searchsorted(cu[1:], after, right=True)
        cap_off = (after - cu[seq]).contiguous()
    rc = lib.pf_gdn(
        code, ssm_code, _ptr(view.raw), pb, _ptr(pages), pages.shape[1], offs["conv"],
        offs["ssm"], _ptr(fresh) if fresh is not None else None, _ptr(cu), _ptr(mixed),
        mixed.stride(0), _ptr(a), _ptr(b), a.stride(0), _ptr(conv_weight), _ptr(neg_exp_alog),
        _ptr(dt_bias), _ptr(out), pages.shape[0], c, k, num_k_heads, num_v_heads, head_k_dim,
        head_v_dim, float(head_k_dim**-0.5 if scale is None else scale),
        _ptr(cap_cu) if cap_cu is not None else None,
        _ptr(cap_off) if cap_off is not None else None,
        _ptr(cap_pages) if cap_pages is not None else None, torch.get_num_threads())
    return out if rc == 0 else None


def mamba2_decode(view, page_ids: torch.Tensor, has_initial_state: torch.Tensor,
                  xbc: torch.Tensor, dt: torch.Tensor, conv_weight: torch.Tensor,
                  conv_bias: torch.Tensor | None, dt_bias: torch.Tensor, A_log: torch.Tensor,
                  D: torch.Tensor, *, num_heads: int, head_dim: int, n_groups: int,
                  state_size: int) -> torch.Tensor | None:
    """A Mamba-2 mixer's decode step (one token per sequence): the conv and the SSM update on
    the states in their pages (read once, written back in place: no gather, no scatter).

    ``xbc`` (N, conv_dim) the conv input, ``dt`` (N, H) the raw time step, ``conv_weight``
    (conv_dim, K); A = ``-exp(A_log)``. Equals ``causal_conv1d_update`` + softplus +
    ``ssd_recurrent`` (with the D term) + storing both states, up to float32 rounding. Returns
    ``y`` (N, H * head_dim) in xbc's dtype, or None when not handled (nothing written): other
    dtypes, a conv window longer than K - 1 (speculative decoding), a non-float32 SSM state.
    """
    found = _state_kernel(view)
    if found is None:
        return None
    lib, conv, ssm, offs = found
    n, c = xbc.shape
    k = conv_weight.shape[1]
    code = _usable(xbc, dt, conv_weight, *(() if conv_bias is None else (conv_bias,)))
    if (code is None or conv.dtype != xbc.dtype or conv.shape != (c, k - 1)
            or ssm.dtype != torch.float32
            or ssm.shape != (num_heads, head_dim, state_size)
            or not view.raw.is_contiguous() or not _rows_ok(xbc) or not _rows_ok(dt)
            or not conv_weight.is_contiguous() or page_ids.shape[0] != n):
        return None
    pages = page_ids.contiguous()
    fresh = _fresh_flags(has_initial_state)
    small = [dt_bias.detach().float().contiguous(), _neg_exp(A_log),
             D.detach().float().contiguous()]
    y = torch.empty((n, num_heads * head_dim), dtype=xbc.dtype)
    rc = lib.pf_mamba2_decode(
        code, _ptr(view.raw), view.page_bytes, _ptr(pages), pages.shape[1], offs["conv"],
        offs["ssm"], _ptr(fresh) if fresh is not None else None, _ptr(xbc), xbc.stride(0),
        _ptr(dt), dt.stride(0), _ptr(conv_weight),
        _ptr(conv_bias) if conv_bias is not None else None, *(_ptr(t) for t in small),
        _ptr(y), n, c, k, num_heads, head_dim, n_groups, state_size, torch.get_num_threads())
    return y if rc == 0 else None


# Rows up to which bf16 linears take the compiled GEMV, not the GEMM library. With native bf16
# (AVX512-BF16 / AMX) oneDNN is as fast from 3 rows on. Elsewhere its bf16 GEMM costs about a
# weight pass per row, and the AVX2 kernel (weights read once per call) stays 3-4x ahead up to
# FMA_MAX_ROWS (benchmarks/bf16_gemv.py: decode batches, verify steps, short prefill chunks);
# the float32-upcast GEMM (gemm.py, on by default there) takes more rows. In isolation it
# caught up at ~20-24 rows, but in a model, whose weights stream from memory, a batch-32
# SmolLM2 decode step took 140-183 ms with the kernel against 193-200 ms with the upcast from
# 21 rows (Zen 3, interleaved): the kernel keeps its 32 either way. With AMX the tile kernel
# (gemv_amx.cpp) costs about one weight pass for 1 to 16 rows (~1.2 for 17 to 32: each
# weight tile times two x tiles), below both the AVX512-BF16 GEMV (compute bound from ~2
# rows) and oneDNN (a fixed per-call cost):
# AMX_MAX_ROWS (``PAGEFOLD_AMX=0`` keeps the AVX512-BF16 GEMV, for comparisons).
FMA_MAX_ROWS = 32
AMX_MAX_ROWS = 32
NATIVE_MAX_ROWS = 2
GEMV_MAX_ROWS = NATIVE_MAX_ROWS if gemm._cpu_has_fast_bf16() else FMA_MAX_ROWS
PREPACK_LIMIT_BYTES = 2 << 30
_gemv = None  # the C function linear() and the native decode step call (set with the library)
_gemv_f32 = None  # its float32-output twin where there is one (the AVX2 + FMA kernel)


def _choose_gemv(lib: ctypes.CDLL) -> None:
    """Pick the GEMV and its row limit for this CPU: the AVX2 + FMA kernel where the CPU has
    no native bf16 GEMM and the build has the kernel; the AMX tile kernel where the build has
    it and the OS grants the tile state; else ``pf_linear_bf16`` (AVX512-BF16, or a scalar
    loop: then only for ``NATIVE_MAX_ROWS`` rows). Each keeps a row's bits independent of how
    many rows share a call, so verify steps compute what decode steps would."""
    global _gemv, _gemv_f32, GEMV_MAX_ROWS
    _gemv_f32 = None
    if not gemm._cpu_has_fast_bf16() and lib.pf_gemv_kinds() & 2:
        _gemv, _gemv_f32 = lib.pf_linear_bf16_fma, lib.pf_linear_bf16_fma_f32out
        GEMV_MAX_ROWS = FMA_MAX_ROWS
    elif (gemm._cpu_has_fast_bf16() and os.environ.get("PAGEFOLD_AMX", "1") != "0"
          and lib.pf_amx_ready()):
        _gemv, GEMV_MAX_ROWS = lib.pf_linear_bf16_amx, AMX_MAX_ROWS
    else:
        _gemv, GEMV_MAX_ROWS = lib.pf_linear_bf16, NATIVE_MAX_ROWS


def gemv_function():
    """The ctypes function behind :func:`linear` (``pf_linear_bf16``'s arguments), or None
    when the kernels are off."""
    return _gemv if kernels() is not None else None


_gemv_addr: tuple = (None, None)


def gemv_address() -> ctypes.c_void_p | None:
    """:func:`gemv_function`'s address, for the C drivers that call it themselves
    (``pf_dense_decode``, ``pf_moe_experts_few``); None when the kernels are off."""
    global _gemv_addr
    fn = gemv_function()
    if fn is None:
        return None
    if _gemv_addr[0] is not fn:
        _gemv_addr = (fn, ctypes.cast(fn, ctypes.c_void_p))
    return _gemv_addr[1]


def _linear_call(fn, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor | None:
    if (weight.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or x.dim() != 2
            or x.shape[0] < 1 or x.device.type != "cpu" or weight.device.type != "cpu"
            or weight.dim() != 2 or not weight.is_contiguous() or x.stride(1) != 1
            or x.shape[1] != weight.shape[1]
            or (bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()
                                      or bias.numel() != weight.shape[0]))):
        return None
    n, k = weight.shape
    m = x.shape[0]
    y = torch.empty((m, n), dtype=out_dtype)
    rc = fn(_ptr(x), x.stride(0), _ptr(weight), _ptr(bias) if bias is not None else None,
            _ptr(y), n, m, n, k, torch.get_num_threads())
    return y if rc == 0 else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
           ) -> torch.Tensor | None:
    """``x @ weight.T + bias`` for bf16 inputs of at most ``GEMV_MAX_ROWS`` rows (decode steps
    of small batches, speculative verify steps), float32 sums and one rounding, as oneDNN's
    bf16 matmul; None otherwise (more rows: the GEMM library is the faster one)."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or kernels() is None \
            or not 1 <= x.shape[0] <= GEMV_MAX_ROWS:
        return None
    return _linear_call(_gemv, x, weight, bias)


def linear_fma(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
               ) -> torch.Tensor | None:
    """The AVX2 + FMA kernel itself for any number of rows, whatever this CPU's routing (for
    tests and benchmarks); None where it is not compiled in or the inputs are not handled."""
    lib = kernels()
    if lib is None or not lib.pf_gemv_kinds() & 2:
        return None
    return _linear_call(lib.pf_linear_bf16_fma, x, weight, bias)


def float_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                 ) -> torch.Tensor | None:
    """``x @ weight.T + bias`` as float32 (the sums unrounded) for bf16 inputs, on CPUs whose
    bf16 products are pagefold's own float32 ones (no native bf16: the AVX2 + FMA kernel for
    up to ``GEMV_MAX_ROWS`` rows, the float32-upcast GEMM above); None elsewhere. For lm_heads:
    bf16-rounded logits tie (SmolLM2's "The" and "L" at -1.876 on the demo question), and a
    tie is broken by token id, not by the model."""
    if (_gemv_f32 is None or x.dtype != torch.bfloat16 or x.dim() != 2 or kernels() is None
            or x.shape[0] < 1):
        return None
    if x.shape[0] <= GEMV_MAX_ROWS or not gemm.upcast_enabled():
        return _linear_call(_gemv_f32, x, weight, bias, torch.float32)
    return gemm.linear(x, weight, bias, out_float=True)


def _gemv_ready(mod: torch.nn.Linear) -> tuple | None:
    """``(weight, bias)`` of ``mod`` when the GEMV takes them as they are (checked once per
    weight object: the per-call checks of :func:`linear` cost more than a small GEMV)."""
    w, b = mod.weight, mod.bias
    if (_lib is None or w.dtype != torch.bfloat16 or w.device.type != "cpu"
            or not w.is_contiguous() or w.dim() != 2
            or (b is not None and (b.dtype != torch.bfloat16 or not b.is_contiguous()))):
        return None
    return (w, b)


def _fast_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 2 and x.dtype == torch.bfloat16:
        if self.pf_float_out:
            y = float_logits(x, self.weight, self.bias)
            if y is not None:
                return y
        if x.shape[0] <= GEMV_MAX_ROWS:
            ready = self.pf_gemv
            w, b = self.weight, self.bias
            if ready is not None and ready[0] is w and ready[1] is b and x.is_cpu \
                    and x.stride(1) == 1 and x.shape[0] >= 1 and x.shape[1] == w.shape[1]:
                # The checks of linear() done once (same weight objects): straight to the GEMV.
                n, k = w.shape
                m = x.shape[0]
                y = torch.empty((m, n), dtype=torch.bfloat16)
                if _gemv(x.data_ptr(), x.stride(0), w.data_ptr(),
                                       b.data_ptr() if b is not None else None, y.data_ptr(),
                                       n, m, n, k, torch.get_num_threads()) == 0:
                    return y
            y = linear(x, self.weight, self.bias)
            if y is not None:
                return y
        y = gemm.linear(x, self.weight, self.bias)  # no native bf16 GEMM on this CPU
        if y is not None:
            return y
        packed = self.pf_packed_weight
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
    return torch.nn.functional.linear(x, self.weight, self.bias)


def _prepack(weight: torch.Tensor) -> torch.Tensor | None:
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    except (AttributeError, RuntimeError):
        return None


def use_fast_linears(model: torch.nn.Module, prepack_limit: int = PREPACK_LIMIT_BYTES) -> int:
    """Route this model's ``nn.Linear`` layers (the instances, not the class) through the
    fastest CPU path for bf16 inputs: :func:`linear` for up to ``GEMV_MAX_ROWS`` rows, else
    oneDNN with the weight reordered once into its blocked layout (``F.linear`` reorders it
    on every call, which for decode-sized batches costs more than the product); on CPUs with
    no native bf16 GEMM, :func:`pagefold.csrc.gemm.linear` above ``GEMV_MAX_ROWS`` rows
    (float32 sums and one rounding, as oneDNN; the packed copies are then not made). The
    oneDNN results are the same bits as ``F.linear``. The reordered copies double the linear
    weights' memory, so they are made only when those weights total at most
    ``prepack_limit`` bytes. lm_heads (``pf_logits``, set by ``layers.vocab.lm_head_linear``)
    return float32 logits where :func:`float_logits` applies. Call again after changing
    weights. Returns how many layers were routed."""
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    total = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    # Where bf16 products go through float32 (gemm.py), a packed bf16 copy would only cost
    # memory.
    pack = total <= prepack_limit and not gemm.upcast_enabled()
    for mod in linears:
        w = mod.weight
        # lm_heads (a target's, a draft's): float32 logits where the products are pagefold's
        # own (float_logits), so bf16 rounding never ties them.
        mod.pf_float_out = getattr(mod, "pf_logits", False)
        mod.pf_packed_weight = (_prepack(w.detach()) if pack and w.dtype == torch.bfloat16
                                and w.device.type == "cpu" else None)
        mod.pf_gemv = _gemv_ready(mod) if kernels() is not None else None
        mod.forward = _fast_linear_forward.__get__(mod)
    return len(linears)
