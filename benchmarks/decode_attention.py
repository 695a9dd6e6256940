"""Decode attention alone: the compiled kernel's K/V read rate over paged caches.

    python -m benchmarks.decode_attention                    # this CPU's native build
    . benchmarks/avx2_env.sh && python -m benchmarks.decode_attention --threads 2   # AVX2 path

Each shape is ``batch`` rows of ``ctx`` keys (every row its own blocks, shuffled over the
pool as a running engine leaves them), ``heads`` query heads over ``kv_heads`` of
``head_dim``, bf16, block size 16, ``--layers`` layers (one cache each, so K/V come from
memory as in a model step, not from the last layer's cache lines). Columns: ``ms`` = the
best of ``--repeats`` over all layers, ``GB/s`` = K/V bytes read / that time, ``copy GB/s``
= bytes read and written / time of a ``torch`` copy of a buffer as large as the caches (the
bandwidth limit), ``vs copy`` = their ratio; ``ms, AMX tiles off``: with grouped query heads,
the same with ``pf_decode_attention_amx(0)`` (the AVX-512 loops; equal to ``ms`` where this
build or CPU has no AMX).
"""

from __future__ import annotations

import argparse

from benchmarks.common import best_seconds, print_table, torch_threads

# (label, batch, keys per row, query heads, kv heads, head dim)
SHAPES = [
    ("MHA b32", 32, 320, 12, 12, 64),
    ("MHA b4 long", 4, 3000, 12, 12, 64),
    ("MHA b1 long", 1, 3000, 12, 12, 64),
    ("GQA 4:1 b32", 32, 320, 16, 4, 64),
    ("GQA 8:1 d128 b16", 16, 1000, 16, 2, 128),
    ("GQA 4:1 d128 b1 long", 1, 3000, 32, 8, 128),
    ("GQA 8:1 d128 b4 long", 4, 3100, 16, 2, 128),
    ("GQA 2:1 d64 b8", 8, 1000, 8, 4, 64),
    ("GQA 8:1 d256 b4", 4, 2000, 16, 2, 256),
]


def run_shape(label, batch, ctx, heads, kv_heads, head_dim, layers, repeats) -> dict:
    import torch

    from pagefold.ops.attention import cpu as attn_cpu

    bs = 16
    per_row = -(-ctx // bs)
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(batch * per_row + 1, bs, 2, kv_heads, head_dim, generator=g)
              .bfloat16() for _ in range(layers)]
    tables = torch.randperm(batch * per_row, generator=g).view(batch, per_row) + 1
    seq_lens = torch.full((batch,), ctx, dtype=torch.int64)
    q = torch.randn(batch, heads, head_dim, generator=g).bfloat16()
    out = torch.empty_like(q)
    scale = head_dim ** -0.5

    def step() -> None:
        for c in caches:
            assert attn_cpu.decode_attention(q, None, c, tables, seq_lens, None, scale, out)

    from pagefold.csrc import cpu_ops

    lib = cpu_ops.kernels()
    best = best_seconds(step, repeats)
    no_amx = None
    if lib is not None and heads // kv_heads >= 3:  # the AMX tiles. shapes: without them too
        before = lib.pf_decode_attention_amx(0)
        try:
            no_amx = best_seconds(step, repeats)
        finally:
            lib.pf_decode_attention_amx(before)
        best = min(best, best_seconds(step, repeats))  # again: noise hits both
    kv_bytes = layers * batch * ctx * 2 * kv_heads * head_dim * 2
    src = torch.empty(kv_bytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    copy = best_seconds(lambda: dst.copy_(src), repeats)
    gbs, copy_gbs = kv_bytes / best / 1e9, 2 * kv_bytes / copy / 1e9
    return {"shape": label, "batch": batch, "keys": ctx, "heads": f"{heads}/{kv_heads}",
            "head dim": head_dim, "ms": 1000 * best, "GB/s": gbs, "copy GB/s": copy_gbs,
            "vs copy": gbs / copy_gbs,
            "ms, AMX tiles off": None if no_amx is None else 1000 * no_amx}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--shapes", nargs="+", default=None, help="labels of SHAPES to run")
    args = p.parse_args(argv)
    shapes = [s for s in SHAPES if args.shapes is None or s[0] in args.shapes]
    with torch_threads(args.threads):
        rows = [run_shape(*s, args.layers, args.repeats) for s in shapes]
    print_table(rows, list(rows[0]))
    return rows


if __name__ == "__main__":
    main()
