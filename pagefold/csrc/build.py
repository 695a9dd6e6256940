"""Building and loading pagefold's compiled CPU kernels (see :mod:`pagefold.csrc.cpu_ops`).

One ``g++`` call builds every source below into one shared object, cached under
``$PAGEFOLD_CACHE/kernels`` (default ``~/.cache/pagefold/kernels``) and keyed by the sources,
the flags, the compiler's version and this CPU's flags (the build uses ``-march=native``), so
a later process loads it at once and another CPU rebuilds. :func:`load` builds (when needed),
loads and declares every entry point's C signature.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

_DIR = Path(__file__).parent
_SOURCES = [_DIR / "attention.cpp", _DIR / "attention_amx.cpp", _DIR / "prefill.cpp",
            _DIR / "prefill_blocked.cpp",
            _DIR / "layers.cpp", _DIR / "gdn.cpp",
            _DIR / "gemv_amx.cpp", _DIR / "mamba2.cpp", _DIR / "ssd.cpp",
            _DIR / "conv.cpp", _DIR / "gated_norm.cpp", _DIR / "decode_step.cpp",
            _DIR / "moe.cpp", _DIR / "pages.cpp", _DIR / "quant.cpp",
            _DIR / "gguf_quant.cpp", _DIR / "lora.cpp", _DIR / "qgemv_q8.cpp",
            _DIR / "quant_linear.cpp", _DIR / "mxfp4.cpp", _DIR / "qgemm_amx.cpp"]
_HEADERS = [_DIR / "common.h", _DIR / "kernels.h", _DIR / "q8_act.h"]
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
_loaded: list[str] = []  # the key of the library load() returned


def cache_root() -> Path:
    """pagefold's cache directory: ``$PAGEFOLD_CACHE``, default ``~/.cache/pagefold``."""
    return Path(os.environ.get("PAGEFOLD_CACHE") or Path.home() / ".cache" / "pagefold")


def _cache_dir() -> Path:
    return cache_root() / "kernels"


def _cpuinfo(field: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line
    except OSError:
        pass
    return None


def cpu_flags() -> str:
    """This CPU's flags line (/proc/cpuinfo), else the platform's processor name."""
    import platform

    return _cpuinfo("flags") or platform.processor() or platform.machine()


def cpu_model() -> str:
    """This CPU's model name (/proc/cpuinfo), else the platform's processor name."""
    import platform

    line = _cpuinfo("model name")
    return line.split(":", 1)[1].strip() if line else platform.processor() or "unknown"


def build_id() -> str | None:
    """The loaded library's build key (its sources, flags, compiler and CPU flags), None
    before :func:`load` succeeded."""
    return _loaded[-1] if _loaded else None


def _compiler() -> str | None:
    cxx = os.environ.get("CXX") or "g++"
    return shutil.which(cxx)


def _build(cxx: str) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        b"\0".join(s.encode() for s in (*(f.read_text() for f in _SOURCES + _HEADERS),
                                         " ".join(_FLAGS), version, cpu_flags()))
    ).hexdigest()[:16]
    out = _cache_dir() / f"pf_cpu_ops-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed: concurrent builds never load a half-written file.
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    res = subprocess.run([cxx, *_FLAGS, *map(str, _SOURCES), "-o", str(tmp)],
                         capture_output=True, text=True, timeout=300)
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
    lib.pf_decode_attention_amx.argtypes = [i32]
    lib.pf_decode_attention_amx.restype = i32
    lib.pf_decode_attention_amx_calls.argtypes = []
    lib.pf_decode_attention_amx_calls.restype = i64
    lib.pf_write_kv.argtypes = [i32, p, p, i64, i64, p, p, i32, i32, i32]
    lib.pf_prefill_attention.argtypes = [p, i64, p, p, p, i32, p, i64, i32, i32, i32, i32, f32,
                                         i32]
    lib.pf_prefill_attention.restype = i32
    for name in ("pf_prefill_attention_amx", "pf_prefill_attention_blocked"):
        getattr(lib, name).argtypes = lib.pf_prefill_attention.argtypes
        getattr(lib, name).restype = i32
    lib.pf_prefill_blocked_ready.restype = i32
    lib.pf_write_kv.restype = i32
    lib.pf_rms_norm.argtypes = [i32, p, i64, p, i64, p, p, i64, i64, i32, f32, i32, i32]
    lib.pf_rms_norm.restype = i32
    lib.pf_qk_norm_rope.argtypes = [
        i32, p, i64, i64, i64, i64,  # dtype, qkv, row_stride, q_off, q_head_stride, k_off
        p, p, p, i32,  # positions, cos, sin, rot
        p, p, f32, i32,  # q/k norm weights, eps, zero_centered
        p, p, i64, i32, i32, i32, i32,  # q_out, k_out, N, H, KVH, D, threads
    ]
    lib.pf_qk_norm_rope.restype = i32
    lib.pf_silu_mul.argtypes = [i32, p, i64, p, i64, i32, i32]
    lib.pf_rms_norm_gated.argtypes = [i32, p, i64, i64, p, i64, i64, p, p, i64, i32, i32, f32,
                                      i32]
    lib.pf_rms_norm_gated.restype = i32
    lib.pf_silu_mul.restype = i32
    lib.pf_gdn.argtypes = [
        i32, i32, p, i64, p, i32,  # dtype, ssm dtype, raw, page_bytes, pages, pages per state
        i64, i64, p, p,  # conv_off, ssm_off, fresh, cu_seqlens
        p, i64, p, p, i64,  # x, x_stride, a, b, ab_stride
        p, p, p, p,  # conv_w, neg_exp_alog, dt_bias, out
        i64, i32, i32, i32, i32, i32, i32, f32,  # N, C, K, Hk, Hv, Dk, Dv, scale
        p, p, p, i32,  # capture cu / offsets / pages, threads
    ]
    lib.pf_gdn.restype = i32
    lib.pf_mamba2_decode.argtypes = [
        i32, p, i64, p, i32, i64, i64, p,  # dtype, raw, page_bytes, pages, P, offsets, fresh
        p, i64, p, i64, p, p,  # xbc, x_stride, dt, dt_stride, conv_w, conv_b
        p, p, p, p,  # dt_bias, A, D, y
        i64, i32, i32, i32, i32, i32, i32, i32,  # N, C, K, H, Dh, G, Ns, threads
    ]
    lib.pf_mamba2_decode.restype = i32
    lib.pf_ssd_chunked.argtypes = [
        i32, i32, p, i64, p, p, i64,  # x / B,C dtypes, x, x_stride, B, C, bc_stride
        p, i64,  # dt, dt_stride
        p, p, p, p, p, i64, p,  # A, D, init, final, cu, S, y
        i32, i32, i32, i32, i32, p, p, i64,  # H, P, G, N, L, captures (tok, out, M)
        p, i64, p, i32, i64, i32,  # paged captures (raw, page bytes, pages, P, offset), thr
    ]
    lib.pf_ssd_chunked.restype = i32
    lib.pf_page_write.argtypes = [p, i64, p, i64, i32, i64, p, i64, i64, i32, i32]
    lib.pf_page_write.restype = i32
    lib.pf_conv_varlen.argtypes = [i32, p, i64, p, p, p, p, p, i64, p, i32, i32, i32,
                                   p, i64, p, i64, p, i32, i64, i32]
    lib.pf_conv_varlen.restype = i32
    lib.pf_gated_norm_gate_first.argtypes = [i32, i32, i32, p, i64, p, i64, p, p, i64, i32, i32,
                                             f32, i32]
    lib.pf_gated_norm_gate_first.restype = i32
    lib.pf_lora_shrink.argtypes = [i32, p, i64, p, p, p, i64, i32, i32, i32]
    lib.pf_lora_shrink.restype = i32
    lib.pf_lora_expand.argtypes = [i32, p, i64, p, p, p, i64, i32, i32, i32]
    lib.pf_lora_expand.restype = i32
    lib.pf_linear_bf16.argtypes = [p, i64, p, p, p, i64, i32, i64, i64, i32]
    lib.pf_linear_bf16.restype = i32
    lib.pf_linear_bf16_fma.argtypes = lib.pf_linear_bf16.argtypes
    lib.pf_linear_bf16_fma.restype = i32
    lib.pf_linear_bf16_fma_f32out.argtypes = lib.pf_linear_bf16.argtypes
    lib.pf_linear_bf16_fma_f32out.restype = i32
    lib.pf_linear_bf16_amx.argtypes = lib.pf_linear_bf16.argtypes
    lib.pf_linear_bf16_amx.restype = i32
    lib.pf_amx_ready.restype = i32
    lib.pf_argmax_bf16.argtypes = [p, i64, i64, i64, p]
    lib.pf_argmax_bf16.restype = i32
    lib.pf_relu2.argtypes = [i32, p, i64, p, i64, i32, i32]
    lib.pf_relu2.restype = i32
    lib.pf_sigmoid_gate.argtypes = [i32, p, i64, p, i64, i64, p, i64, i64, i32, i32, i32]
    lib.pf_sigmoid_gate.restype = i32
    lib.pf_blocks_decode.argtypes = [p, p, i32, p, p, p, p, p, p, i64, i64, p, i32, p, p,
                                     f32, i32, p]
    lib.pf_blocks_decode.restype = i32
    lib.pf_blocks_decode_fields.restype = i32
    lib.pf_blocks_greedy.argtypes = [p, f32]
    lib.pf_blocks_greedy.restype = i32
    lib.pf_blocks_greedy_fields.restype = i32
    lib.pf_moe_experts_few.argtypes = [p, p, p, i64, i32, i32, p, p, p, p, i32, i64, i64, p,
                                        i32]
    lib.pf_moe_experts_few.restype = i32
    lib.pf_moe_experts_grouped.argtypes = [p, p, p, i64, i32, p, p, i32, i32, i32, p, p, i64,
                                            i64, p, i32]
    lib.pf_moe_experts_grouped.restype = i32
    lib.pf_moe_combine.argtypes = [p, p, i32, i32, p, i64, p, i32]
    lib.pf_moe_combine.restype = i32
    lib.pf_moe_route.argtypes = [p, i64, i32, i32, i32, i32, p, p, i32]
    lib.pf_moe_route.restype = i32
    lib.pf_moe_shared_add.argtypes = [p, p, p, i64, p, i64, i64, i32]
    lib.pf_moe_shared_add.restype = i32
    lib.pf_gemv_kinds.restype = i32
    lib.pf_qgemv_int.argtypes = [p, i64, i64, i64, p, i32, i32, i64, p, p, p, i64, i32]
    lib.pf_qgemv_int.restype = i32
    lib.pf_qgemv_affine.argtypes = [p, i64, i64, i64, p, i32, i64, p, p, i32, p, i64, i32]
    lib.pf_qgemv_affine.restype = i32
    lib.pf_gguf_limit_isa.argtypes = [i32]
    lib.pf_gguf_limit_isa.restype = i32
    lib.pf_qgemv_affine_q8.argtypes = lib.pf_qgemv_affine.argtypes
    lib.pf_qgemv_affine_q8.restype = i32
    lib.pf_affine_decode_bf16.argtypes = [p, i32, i64, p, p, i32, i64, i64, p, i64, i32]
    lib.pf_affine_decode_bf16.restype = i32
    lib.pf_qgemv_q8_limit_isa.argtypes = [i32]
    lib.pf_qgemv_q8_limit_isa.restype = i32
    lib.pf_qgemv_q8_takes.argtypes = [i32, i64]
    lib.pf_qgemv_q8_takes.restype = i32
    lib.pf_qgemm_affine_q8.argtypes = lib.pf_qgemv_affine.argtypes
    lib.pf_qgemm_affine_q8.restype = i32
    lib.pf_qgemm_q8_from.argtypes = [i32]
    lib.pf_qgemm_q8_from.restype = i32
    lib.pf_qgemm_q8_takes.argtypes = [i32, i64]
    lib.pf_qgemm_q8_takes.restype = i32
    lib.pf_qgemv_mxfp4.argtypes = [p, i64, i64, i64, p, p, p, i64, i32]
    lib.pf_qgemv_mxfp4.restype = i32
    lib.pf_mxfp4_limit_isa.argtypes = [i32]
    lib.pf_mxfp4_limit_isa.restype = i32
    lib.pf_quant_matrix_words.restype = i32
    lib.pf_linear_quant.argtypes = lib.pf_linear_bf16.argtypes
    lib.pf_linear_quant.restype = i32
    for name in ("pf_max_head_dim", "pf_max_group", "pf_max_block"):
        getattr(lib, name).restype = i32


def load() -> ctypes.CDLL:
    """The library, built when this source/compiler/CPU combination has no cached build yet;
    raises (with the compiler's message) when it cannot be built."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) on PATH")
    path = _build(cxx)
    lib = ctypes.CDLL(str(path))
    _declare(lib)
    _loaded.append(path.stem.rsplit("-", 1)[-1])
    return lib
