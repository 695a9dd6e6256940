"""bf16 prefill attention over the paged cache: the kernels side by side on one chunk each.

    python -m benchmarks.prefill_attention [--threads 2] [--reps 5]

Per (heads, kv heads, head dim, cached tokens, chunk tokens), the best time in ms of:

  * ``amx``: the blocked kernel on AMX tiles (``pf_prefill_attention_amx``,
    ``csrc/prefill_blocked.cpp``);
  * ``blocked``: the same on AVX512-BF16 dot products (``pf_prefill_attention_blocked``);
  * ``rows``: the one-row-at-a-time AVX512-BF16 kernel (``pf_prefill_attention``,
    ``csrc/prefill.cpp``);
  * ``sdpa``: ATen's flash attention as the backend calls it for head dims the blocked kernels
    decline (a fresh chunk: one causal call; a later chunk: the cached prefix and the chunk
    as two calls merged by their log-sum-exps, ``backend.sdpa_after_prefix``).

The kernels read K/V from a paged cache (pages in order); SDPA gets them as contiguous tensors
(the gather it would need is not counted). GFLOP/s counts 4 * head dim flops per (query, key,
head) pair the causal mask keeps. Columns are absent where the CPU or build lacks a kernel.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import print_table

CASES = [  # (heads, kv heads, head dim, cached tokens, chunk tokens)
    (9, 3, 64, 0, 2048), (9, 3, 64, 2048, 1024), (9, 3, 64, 0, 256),
    (16, 2, 128, 0, 2048), (16, 2, 128, 1000, 16), (8, 8, 64, 0, 2048),
    (16, 4, 64, 0, 256), (16, 4, 64, 0, 64),
]
BLOCK = 16


def _best(fn, reps: int) -> float:
    fn()
    n = max(1, int(0.2 / max(1e-6, _once(fn))))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best


def _once(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _case(h: int, kvh: int, d: int, ctx: int, n: int, reps: int) -> dict:
    """One chunk of ``n`` tokens after ``ctx`` cached ones: each kernel's best time."""
    from pagefold.csrc import cpu_ops
    from pagefold.ops.attention import cpu as attn_cpu
    from pagefold.ops.attention.reference import flash_cpu, sdpa_after_prefix

    length = ctx + n
    cache = torch.randn(-(-length // BLOCK), BLOCK, 2, kvh, d).to(torch.bfloat16)
    slots = torch.arange(length)
    q = torch.randn(n, h, d).to(torch.bfloat16)
    rows = torch.tensor([[0, n, ctx, 0, 0]])
    out = torch.empty_like(q)
    scale = d**-0.5
    times = {}

    def run(kernel: str) -> bool:
        return attn_cpu.prefill_attention(q, cache, rows, slots, None, scale, out, kernel=kernel)

    if cpu_ops.kernels() is not None:
        for name in ("amx", "blocked", "rows"):
            if run(name):
                times[name] = _best(lambda name=name: run(name), reps)
    if flash_cpu is not None:
        kv = cache.flatten(0, 1)[:length]

        def heads(t: torch.Tensor) -> torch.Tensor:  # (L, KVH, D) -> (1, H, L, D)
            return t.transpose(0, 1).repeat_interleave(h // kvh, 0).unsqueeze(0)

        k, v, pk, pv = heads(kv[ctx:, 0]), heads(kv[ctx:, 1]), heads(kv[:ctx, 0]), heads(
            kv[:ctx, 1])
        qs = q.transpose(0, 1).unsqueeze(0)
        if ctx:
            times["sdpa"] = _best(lambda: sdpa_after_prefix(qs, k, v, pk, pv, scale), reps)
        else:
            times["sdpa"] = _best(lambda: flash_cpu(qs, k, v, 0.0, True, scale=scale), reps)
    row = {"shape": f"{h}/{kvh}/{d}", "cached": ctx, "chunk": n}
    flops = 4 * (n * ctx + n * (n + 1) / 2) * h * d
    for name, t in times.items():
        row[f"{name} ms"] = t * 1e3
        row[f"{name} GF/s"] = flops / t / 1e9
    best = min((times[k] for k in ("amx", "blocked") if k in times), default=None)
    for other in ("rows", "sdpa"):  # how much slower than the faster blocked kernel
        if best is not None and other in times:
            row[f"{other} / best"] = times[other] / best
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows_out = [_case(*c, args.reps) for c in CASES]
    cols = ["shape", "cached", "chunk"]
    for name in ("amx", "blocked", "rows", "sdpa"):
        if any(f"{name} ms" in r for r in rows_out):
            cols += [f"{name} ms", f"{name} GF/s"]
    cols += [c for c in ("rows / best", "sdpa / best") if any(c in r for r in rows_out)]
    print(f"threads {torch.get_num_threads()}")
    print_table(rows_out, cols)


if __name__ == "__main__":
    main()
