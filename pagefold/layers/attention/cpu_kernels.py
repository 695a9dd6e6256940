"""Compiled CPU kernels for the paged cache, built on first use and loaded through ctypes.

``csrc/cpu_attention.cpp`` has no torch or Python headers: one ``g++`` call builds it in about
a second. The shared object is cached under ``$PAGEFOLD_CACHE/kernels`` (default
``~/.cache/pagefold/kernels``), keyed by the source, the compiler and this CPU's flags (the
build uses ``-march=native``), so a later process loads it at once and another CPU rebuilds.

Fallback: when the build fails (no compiler) or ``PAGEFOLD_CPU_KERNELS=0``, :func:`kernels`
returns ``None`` and callers take their pure-torch path; the reason is logged once. The
kernels link the OpenMP runtime by soname, so they share the one torch already loaded.

Every wrapper returns ``False`` (and does nothing) when the inputs fall outside what the
kernel handles, so the caller can always fall back.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path

import torch

logger = logging.getLogger("pagefold")

_SRC = Path(__file__).parent / "csrc" / "cpu_attention.cpp"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def enabled() -> bool:
    """False when ``PAGEFOLD_CPU_KERNELS=0`` (tests use it to exercise the torch path)."""
    return os.environ.get("PAGEFOLD_CPU_KERNELS", "1") != "0"


def _cache_dir() -> Path:
    root = os.environ.get("PAGEFOLD_CACHE") or Path.home() / ".cache" / "pagefold"
    return Path(root) / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    cxx = os.environ.get("CXX") or "g++"
    return shutil.which(cxx)


def _build(cxx: str) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        b"\0".join(s.encode() for s in (_SRC.read_text(), " ".join(_FLAGS), version,
                                         _cpu_flags()))).hexdigest()[:16]
    out = _cache_dir() / f"pf_cpu_attention-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed: concurrent builds never load a half-written file.
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    res = subprocess.run([cxx, *_FLAGS, str(_SRC), "-o", str(tmp)], capture_output=True,
                         text=True, timeout=300)
    if res.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{cxx} failed: {res.stderr.strip()[-2000:]}")
    os.replace(tmp, out)
    return out


def _declare(lib: ctypes.CDLL) -> None:
    p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.pf_decode_attention.argtypes = [
        i32,  # dtype
        p, i64, p,  # q, q_stride, rows
        p, p, i64, p, p,  # cache, tables, table_stride, seq_lens, kv_starts
        p, i64,  # out, out_stride
        i32, i32, i32, i32, i32, f32, i32,  # B, H, KVH, D, block_size, scale, threads
    ]
    lib.pf_decode_attention.restype = i32
    lib.pf_write_kv.argtypes = [i32, p, p, i64, i64, p, p, i32, i32, i32]
    lib.pf_write_kv.restype = i32
    for name in ("pf_max_head_dim", "pf_max_group", "pf_max_block"):
        getattr(lib, name).restype = i32


def kernels() -> ctypes.CDLL | None:
    """The loaded library, building it on the first call; ``None`` means use torch."""
    global _lib, _tried
    if _tried or not enabled():
        return _lib if enabled() else None
    with _lock:
        if _tried:
            return _lib
        try:
            cxx = _compiler()
            if cxx is None:
                raise RuntimeError("no C++ compiler (g++ or $CXX) on PATH")
            lib = ctypes.CDLL(str(_build(cxx)))
            _declare(lib)
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
        _ptr(kv_starts) if kv_starts is not None else None, _ptr(out), out.stride(0), seq_lens.shape[0], h, kvh, d, bs, float(scale), torch.get_num_threads())
    return rc == 0


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
