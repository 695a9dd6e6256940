"""Few-row bf16 products with weights streamed from memory, as a model step reads them.

For each weight shape (default: SmolLM2-135M's: qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536, the tied head 49152x576) and row count, every GEMV kernel this CPU and build
run (``pagefold.csrc.gemv_registry``: AMX tiles, AVX512-BF16 dot products, AVX2 + FMA, the
scalar loop) and the GEMM path larger products take (oneDNN on reordered weights, or the
float32-upcast GEMM on CPUs without native bf16) are timed the way the chooser times them
(``pagefold.csrc.gemv_timing``): each call on the next copy of the weight from a buffer larger
than the last-level cache (twice its size by default), the paths taking turns, the least time
over ``--calls`` rounds. Each cell prints microseconds and the fraction of the read bandwidth
measured in the same run (the best of 15 torch sums over a float32 buffer of the same size):
weight bytes / time / bandwidth. ``pick`` is what the chooser decides from these numbers.

    python -m benchmarks.bf16_gemv
    python -m benchmarks.bf16_gemv --rows 1 2 --shapes 49152x576 576x576
    python -m benchmarks.bf16_gemv --threads 1 --stream-mib 1024 --calls 40
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = ["960x576", "576x576", "3072x576", "576x1536", "49152x576"]
ROWS = [1, 2, 4, 8, 16, 32]


def read_bandwidth(nbytes: int, reps: int = 15) -> float:
    """Bytes per second of the best of ``reps`` torch sums over ``nbytes`` of float32."""
    buf = torch.ones(nbytes // 4)
    buf.sum()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="N x K, e.g. 1536x576")
    ap.add_argument("--rows", nargs="+", type=int, default=ROWS)
    ap.add_argument("--calls", type=int, default=20, help="timed rounds per cell")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's); 1 holds up better on a busy host")
    ap.add_argument("--stream-mib", type=int, default=None,
                    help="weight buffer (default: 2x the last-level cache, 64 MiB-4 GiB; the "
                         "chooser caps its own at 256 MiB)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from pagefold.csrc import build, cpu_ops, gemv_choice, gemv_timing

    lib = cpu_ops.kernels()
    if lib is None:
        raise SystemExit("the compiled CPU kernels are not available")
    cands = gemv_choice.available(lib)
    # Past the last-level cache whatever the host reports (a VM may report a whole socket's
    # cache): the chooser caps its buffer at load, this benchmark need not.
    nbytes = (args.stream_mib << 20) if args.stream_mib else max(
        gemv_timing.MIN_STREAM, min(2 * gemv_timing.llc_bytes(), 4 << 30))
    pool = gemv_timing.StreamPool(nbytes=nbytes)
    bw = read_bandwidth(nbytes)
    gemm_path = gemv_timing.gemm_path()
    incumbent = gemv_choice.flags_pick(cands) if cands else None
    print(f"{build.cpu_model()}, {torch.get_num_threads()} threads, LLC "
          f"{gemv_timing.llc_bytes() >> 20} MiB, weights streamed from {nbytes >> 20} MiB; "
          f"read bandwidth {bw / 1e9:.1f} GB/s (torch sum); least of {args.calls} rounds, "
          f"us (fraction of that bandwidth)")
    names = [c.name for c in cands] + [gemm_path]
    print(f"{'N x K':>10} {'M':>3} " + " ".join(f"{n:>16}" for n in names))
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        paths = {c.name: (gemv_timing.gemv_runner(getattr(lib, c.symbol)),
                          lambda n=n, k=k: pool.next(n, k)) for c in cands}
        paths[gemm_path] = gemv_timing.gemm_source(gemm_path, n, k, pool)
        table: dict[str, dict[int, float]] = {nm: {} for nm in names}
        for m in args.rows:
            x = torch.randn(m, k).bfloat16()
            got = gemv_timing.time_rows(paths, x, args.calls, budget_s=10.0)
            cells = []
            for nm in names:
                t = got[nm]
                table[nm][m] = t
                cells.append(f"{t * 1e6:>9.0f} ({2 * n * k / t / bw:4.2f})")
            print(f"{shape:>10} {m:>3} " + " ".join(cells), flush=True)
        if incumbent is not None and set(args.rows) >= set(gemv_choice.ROWS):
            gemm_times = table.pop(gemm_path)
            name, rows = gemv_choice.decide(table, gemm_times, incumbent)
            print(f"{shape:>10} pick: {name} for 1-{rows} rows, {gemm_path} above")


if __name__ == "__main__":
    main()
