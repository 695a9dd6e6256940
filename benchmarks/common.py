"""Shared pieces of the benchmarks: workload generation, the model to run, table printing."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def bench_model(arch: str = "qwen3", hidden: int = 256, layers: int = 4,
                cache_dir: str | None = None, **overrides) -> Path:
    """A tiny random model built once into the pagefold cache (hidden 256, 4 layers default).

    Shapes come from :func:`bench_shape` (scaled with ``hidden``, hybrids included), then
    ``overrides``. Built next to the target and renamed, so a concurrent or interrupted build
    never leaves a directory that looks complete.
    """
    from pagefold.entrypoints.cli import default_cache_dir
    from pagefold.testing.tiny_models import build_tiny_model

    root = Path(cache_dir) if cache_dir else default_cache_dir() / "bench"
    tag = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    out = root / f"{arch}-h{hidden}-l{layers}{('-' + tag) if tag else ''}"
    if not (out / "config.json").exists():
        kw = bench_shape(arch, hidden, layers)
        kw.update(overrides)
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        build_tiny_model(arch, tmp, **kw)
        if (out / "config.json").exists():  # another process won the race: keep its copy
            shutil.rmtree(tmp)
        else:
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
    return out


def bench_shape(arch: str, hidden: int, layers: int) -> dict:
    """Config overrides for a ``hidden``-wide, ``layers``-deep ``arch`` model.

    Attention: ``max(4, hidden // 64)`` heads of ``hidden // heads``, half as many kv heads.
    Hybrids get their state layers scaled too (the tiny test defaults are 16-24 wide):
      * ``qwen3_5`` / ``qwen3_next``: every 4th layer (and the last) is full attention, the rest
        Gated DeltaNet with ``hidden // 128`` key heads and ``hidden // 64`` value heads of 64,
        conv kernel 4; Qwen3.5's mrope sections are rescaled to sum to rotary_dim / 2.
      * ``nemotron_h``: ``layers`` mixers (Mamba-2, with attention at every 4th and the last),
        each followed by an MLP layer (so ``2 * layers`` HF layers); Mamba-2 with
        ``2 * hidden // 64`` heads of 64, 2 groups, state 64, conv 4, chunk 64.
    """
    heads = max(4, hidden // 64)
    head_dim = hidden // heads
    kw: dict = dict(hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                    num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                    head_dim=head_dim)
    is_attn = [i % 4 == 3 or i == layers - 1 for i in range(layers)]
    if arch in ("qwen3_5", "qwen3_next"):
        kw.update(layer_types=["full_attention" if a else "linear_attention" for a in is_attn],
                  linear_num_key_heads=max(1, hidden // 128),
                  linear_num_value_heads=max(2, hidden // 64),
                  linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4)
        if arch == "qwen3_5":
            pairs = int(head_dim * 0.25) // 2  # partial_rotary_factor 0.25
            third = pairs // 3
            kw["rope_parameters"] = dict(
                rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                mrope_section=[pairs - 2 * third, third, third], mrope_interleaved=True)
    elif arch == "nemotron_h":
        del kw["num_hidden_layers"]  # NemotronHConfig derives it from layers_block_type
        mixers = ["full_attention" if a else "linear_attention" for a in is_attn]
        kw.update(layers_block_type=[t for m in mixers for t in (m, "mlp")],
                  mamba_num_heads=max(2, 2 * hidden // 64), mamba_head_dim=64, n_groups=2,
                  ssm_state_size=64, conv_kernel=4, chunk_size=64)
    return kw


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
    widths = {c: max([len(c), *(len(_fmt(r.get(c))) for r in rows)]) for c in cols}
    print("  ".join(c.rjust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in cols))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.2f}"
    return "" if v is None else str(v)


@contextlib.contextmanager
def torch_threads(n: int | None):
    """torch's intra-op threads set to ``n`` (None or 0: left as they are) for the block, then
    restored."""
    import torch

    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def best_seconds(fn, reps: int) -> float:
    """The fastest of ``reps`` timed calls of ``fn`` (after one untimed warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
