"""Few-row bf16 products: pagefold's AVX2 + FMA kernel against torch, per number of rows.

``y = x (M, K) @ w (N, K).T`` on SmolLM2-135M's linear shapes (q/o 576x576, gate/up
1536x576, down 576x1536, the tied head 49152x576) for M = 1 .. 33: ``F.linear`` (oneDNN),
the float32-upcast path (:func:`pagefold.csrc.gemm.linear`, forced on), the AVX2 + FMA
kernel (:func:`pagefold.csrc.cpu_ops.linear_fma`) and, where this CPU has AVX512-BF16, the
bf16 dot-product GEMV (``pf_linear_bf16``). Times are the best of ``--reps`` calls (a shared
machine adds only positive noise), in microseconds; ``F/fma`` = F.linear time / kernel time.

To see a CPU without native bf16 GEMM on one that has it, cap oneDNN at AVX2:

    ONEDNN_MAX_CPU_ISA=AVX2 python -m benchmarks.bf16_gemv
    python -m benchmarks.bf16_gemv --rows 1 2 5 8 --shapes 1536x576
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from benchmarks.common import best_seconds

SHAPES = ["576x576", "1536x576", "576x1536", "49152x576"]
ROWS = [1, 2, 3, 4, 5, 8, 16, 24, 32, 33]


def _best(fn, reps: int) -> float:
    return best_seconds(fn, reps) * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="N x K, e.g. 1536x576")
    ap.add_argument("--rows", nargs="+", type=int, default=ROWS)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)

    from pagefold.csrc import cpu_ops, gemm

    lib = cpu_ops.kernels()
    if lib is None or not lib.pf_gemv_kinds() & 2:
        raise SystemExit("the AVX2 + FMA kernel is not available on this CPU / build")
    dp = lib.pf_linear_bf16 if lib.pf_gemv_kinds() & 1 else None
    os.environ["PAGEFOLD_BF16_UPCAST"] = "force"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, ONEDNN_MAX_CPU_ISA="
          f"{os.environ.get('ONEDNN_MAX_CPU_ISA', '(unset)')}, native bf16 GEMM (torch probe): "
          f"{gemm.cpu_has_fast_bf16()}; best of {args.reps}, us")
    head = f"{'N x K':>10} {'M':>3} {'F.linear':>9} {'fp32-up':>8} {'fma':>8} {'F/fma':>6}"
    print(head + (f" {'dpbf16':>8}" if dp is not None else ""))
    torch.manual_seed(0)
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        w = (torch.randn(n, k) * k**-0.5).bfloat16()
        for m in args.rows:
            x = torch.randn(m, k).bfloat16()
            t_f = _best(lambda x=x, w=w: F.linear(x, w), args.reps)
            t_u = _best(lambda x=x, w=w: gemm.linear(x, w),
                        args.reps) if m >= gemm.MIN_ROWS else float("nan")
            t_k = _best(lambda x=x, w=w: cpu_ops.linear_fma(x, w, None), args.reps)
            row = f"{shape:>10} {m:>3} {t_f:>9.0f} {t_u:>8.0f} {t_k:>8.0f} {t_f / t_k:>6.2f}"
            if dp is not None:
                t_d = _best(lambda x=x, w=w: cpu_ops.linear_call(dp, x, w, None), args.reps)
                row += f" {t_d:>8.0f}"
            print(row, flush=True)


if __name__ == "__main__":
    main()
