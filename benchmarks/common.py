"""Shared pieces of the benchmarks: workload generation, the model to run, table printing."""

from __future__ import annotations

import os
import random
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def bench_model(arch: str = "qwen3", hidden: int = 256, layers: int = 4,
                cache_dir: str | None = None, **overrides) -> Path:
    """A tiny random model built once into the pagefold cache (hidden 256, 4 layers default)."""
    from pagefold.entrypoints.cli import default_cache_dir
    from pagefold.testing.tiny_models import build_tiny_model

    root = Path(cache_dir) if cache_dir else default_cache_dir() / "bench"
    tag = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    out = root / f"{arch}-h{hidden}-l{layers}{('-' + tag) if tag else ''}"
    if not (out / "config.json").exists():
        heads = max(4, hidden // 64)
        kw = dict(hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                  head_dim=hidden // heads)
        kw.update(overrides)
        build_tiny_model(arch, out, **kw)
    return out


def random_workload(n: int, in_len: tuple[int, int], out_len: tuple[int, int], vocab: int,
                    seed: int = 0) -> list[tuple[list[int], int]]:
    """``n`` (prompt ids, output length) pairs; lengths uniform in the inclusive ranges."""
    rng = random.Random(seed)
    work = []
    for _ in range(n):
        li = rng.randint(*in_len)
        lo = rng.randint(*out_len)
        work.append(([rng.randrange(5, vocab) for _ in range(li)], lo))
    return work


def print_table(rows: list[dict], cols: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols}
    print("  ".join(c.rjust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in cols))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.2f}"
    return "" if v is None else str(v)
