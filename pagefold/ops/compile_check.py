"""Compile every Triton kernel for a GPU target without a GPU (Triton's own compiler and
``ptxas``): the check that the kernels the interpreter runs in CI also build for Hopper.

    TRITON_INTERPRET=0 python -m pagefold.ops.compile_check [--arch 90]

The interpreter accepts code the compiler rejects (non-constexpr globals, type mismatches
across branches, unsupported ops), so CI runs this in a subprocess (``TRITON_INTERPRET`` must
be off when the kernels are imported). Prints one line per kernel; exits non-zero on failure.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time

_IDX = {"slots_ptr", "tables_ptr", "seq_lens_ptr", "kv_start_ptr", "rows_ptr", "tiles_ptr",
        "seg_ptr", "cu_ptr", "pages_ptr", "pos_ptr", "coff_ptr", "cap_ptr", "capcu_ptr",
        "cpages_ptr", "tok_ptr", "seq_ptr", "opages_ptr"}
_F32 = {"g_ptr", "beta_ptr", "dt_ptr", "a_ptr", "cos_ptr", "sin_ptr", "inter_ptr", "d_ptr",
        "cst_ptr"}


def _signature(fn, constexprs: dict, dtype: str, overrides: dict) -> dict:
    sig = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in overrides:
            sig[name] = overrides[name]
        elif name in _IDX:
            sig[name] = "*i64"
        elif name == "init_ptr":
            sig[name] = "*i8"
        elif name in _F32:
            sig[name] = "*fp32"
        elif name.endswith("_ptr") or name in ("q_out", "k_out"):
            sig[name] = f"*{dtype}"
        elif name in ("eps", "scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def cases():
    """(label, kernel, constexprs, element dtype, pointer overrides) for every kernel."""
    import triton.language as tl

    from pagefold.ops.attention import triton as at
    from pagefold.ops.conv1d import triton as conv
    from pagefold.ops.elementwise import triton as ew
    from pagefold.ops.gdn import triton as gdn
    from pagefold.ops.gdn import triton_chunked as gdn_chunked
    from pagefold.ops.ssd import triton as ssd
    from pagefold.ops.ssd import triton_chunked as ssd_chunked

    f32, bf16 = tl.float32, tl.bfloat16
    out = [
        ("write_kv", at.write_kv_kernel, dict(ROWS=1, BLOCK_F=1024), "bf16", {}),
        ("rms_norm", ew.rms_norm_kernel,
         dict(HAS_RES=True, ZERO_CENTERED=False, ROWS=4, BLOCK=1024), "bf16", {}),
        ("silu_mul", ew.silu_mul_kernel, dict(ROWS=1, BLOCK=1024), "bf16", {}),
        ("qk_norm_rope", ew.qk_norm_rope_kernel,
         dict(HAS_NORM=True, ZERO_CENTERED=False, BLOCK_J=32, BLOCK=128), "bf16", {}),
        ("rms_norm_gated", ew.rms_norm_gated_kernel, dict(ROWS=32, BLOCK=128), "bf16", {}),
        ("conv", conv.conv_kernel,
         dict(HAS_BIAS=True, SILU=True, HAS_INIT=True, BLOCK_C=256), "bf16", {}),
        ("conv_state", conv.conv_state_kernel, dict(HAS_INIT=True, BLOCK_C=256, BLOCK_K=4),
         "bf16", {}),
        ("conv_window", conv.conv_window_kernel,
         dict(HAS_INIT=True, BLOCK_C=256, BLOCK_K=4), "bf16", {}),
        # The verify pass's form (per-token states, the pages only read).
        ("gdn", gdn.gdn_kernel,
         dict(HAS_INIT=True, L2NORM=True, STORE_INTER=True, STORE_FINAL=False, BLOCK_K=128,
              BLOCK_V=32), "bf16", {"st_ptr": "*fp32"}),
        ("ssd", ssd.ssd_kernel,
         dict(HAS_D=True, HAS_INIT=True, STORE_INTER=False, STORE_FINAL=True, BLOCK_P=32,
              BLOCK_N=128), "bf16", {"st_ptr": "*fp32", "y_ptr": "*fp32"}),
        ("gdn_chunk", gdn_chunked.gdn_chunk_kernel,
         dict(HAS_INIT=True, HAS_POS=True, L2NORM=True, STORE_INTER=True, STORE_CHUNKS=True,
              CAPTURE=True, PREC="tf32", BLOCK_C=64, BLOCK_K=128, BLOCK_V=32), "bf16",
         {"st_ptr": "*fp32", "cb_ptr": "*fp32"}),
        ("ssd_chunk", ssd_chunked.ssd_chunk_kernel,
         dict(HAS_D=True, HAS_INIT=True, HAS_POS=True, STORE_INTER=True, STORE_CHUNKS=True,
              CAPTURE=True, PREC="tf32", BLOCK_C=64, BLOCK_P=32, BLOCK_N=128), "bf16",
         {"st_ptr": "*fp32", "y_ptr": "*fp32", "cb_ptr": "*fp32"}),
    ]
    for name, dt, prec, el in (("bf16", bf16, "tf32", "bf16"), ("fp32", f32, "ieee", "fp32")):
        out.append((f"decode_{name}", at.decode_kernel,
                    dict(HAS_ROWS=True, HAS_START=True, BLOCK_G=16, BLOCK_D=128, BLOCK_N=64,
                         DOT=dt, PREC=prec), el, {}))
        out.append((f"prefill_{name}", at.prefill_kernel,
                    dict(BLOCK_M=16, BLOCK_N=32, BLOCK_D=128, DOT=dt, PREC=prec), el, {}))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability (90: Hopper)")
    p.add_argument("--only", nargs="*", default=None)
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the kernels must be imported in compiled mode")
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failed = 0
    for label, fn, consts, dtype, over in cases():
        if a.only and label not in a.only:
            continue
        t = time.perf_counter()
        try:
            src = ASTSource(fn=fn, signature=_signature(fn, consts, dtype, over),
                            constexprs=consts)
            k = triton.compile(src, target=GPUTarget("cuda", a.arch, 32))
            ok = "cubin" in k.asm
            print(f"{label:16s} ok ({time.perf_counter() - t:.1f}s)" if ok
                  else f"{label:16s} no cubin", flush=True)
            failed += not ok
        except Exception as e:  # noqa: BLE001 - report every kernel
            failed += 1
            print(f"{label:16s} FAILED: {str(e).strip().splitlines()[-1][:300]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
