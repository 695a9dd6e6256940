"""Few-row quantized products in isolation: MXFP4 (gpt-oss experts) and GGUF Q5_K / Q6_K.

* MXFP4, a gpt-oss gate_up expert matrix (5760 x 2880) on bf16 rows: the compiled kernel
  (``pf_qgemv_mxfp4``) against the torch reference it replaced (``mxfp4_reference``: a tile
  decoded, ``F.linear``).
* GGUF Q5_K / Q6_K (2048 x 2048, random super-blocks): ``pf_qgemv_affine_q8`` (int8
  activations; its best form and the AVX2 one) against ``pf_qgemv_affine`` (float32
  activations), on the same rows.

Each cell: milliseconds per product, the mean over repeated calls for about a second (the
weights stay in cache for the GGUF shapes: compute, not memory).

    python -m benchmarks.quant_products --threads 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch


def _ms(fn) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 1.0:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from pagefold.csrc import cpu_ops
    from pagefold.quantization.gguf_kernel import GGUFWeight
    from pagefold.quantization.mxfp4 import mxfp4_linear, mxfp4_reference

    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from gguf_files import _k_blocks

    lib = cpu_ops.kernels()
    if lib is None:
        raise SystemExit("no compiled kernels")
    gen = torch.Generator().manual_seed(0)
    n, k = 5760, 2880
    blocks = torch.randint(0, 256, (n, k // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(118, 130, (n, k // 32), generator=gen, dtype=torch.uint8)
    print(f"MXFP4 {n}x{k}, bf16 rows, {args.threads} thread(s): ms per product")
    for m in args.rows:
        x = torch.randn(m, k).bfloat16()
        a = _ms(lambda x=x: mxfp4_linear(x, blocks, scales))
        b = _ms(lambda x=x: mxfp4_reference(x, blocks, scales))
        print(f"  rows {m:2d}: kernel {a:8.2f}  torch reference {b:8.2f}  ({b / a:.1f}x)")
    rng = np.random.default_rng(0)
    print(f"GGUF 2048x2048, {args.threads} thread(s): ms per product")
    for kind in ("Q5_K", "Q6_K"):
        w = GGUFWeight([(kind, torch.from_numpy(_k_blocks(kind, 2048, 2048, rng)))], 2048)
        for m in args.rows:
            x = torch.randn(m, 2048)
            y = torch.empty(m, 2048)

            def call(fn, bits, x=x, y=y, m=m, w=w):
                return fn(x.data_ptr(), m, 2048, 2048, w.codes.data_ptr(), bits, w.group,
                          w.scale.data_ptr(), w.min.data_ptr(), 0, y.data_ptr(), 2048,
                          args.threads)

            best = _ms(lambda call=call, w=w: call(lib.pf_qgemv_affine_q8, w.q8_bits))
            old = lib.pf_qgemv_q8_limit_isa(1)
            avx2 = _ms(lambda call=call, w=w: call(lib.pf_qgemv_affine_q8, w.q8_bits))
            lib.pf_qgemv_q8_limit_isa(old)
            flt = _ms(lambda call=call, w=w: call(lib.pf_qgemv_affine, w.bits))
            print(f"  {kind} rows {m:2d}: int8 act. best {best:7.3f}  AVX2 {avx2:7.3f}  "
                  f"float32 act. {flt:7.3f}  ({flt / best:.2f}x)")


if __name__ == "__main__":
    main()
