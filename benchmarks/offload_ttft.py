"""TTFT of a returning prompt whose prefix the pool evicted: recomputed, or loaded from the host
tier or the disk tier (issue 38).

    python -m benchmarks.offload_ttft [--arch qwen3_5] [--hidden 512] [--layers 8]
                                      [--prompt 2000] [--rounds 3]

Three engines live side by side with the same small pool (``--pool`` requests of
``--prompt + 16`` tokens, 1.9 by default: room for a request and its state checkpoints, not
for two requests): ``recompute`` (prefix caching on, no tier), ``host``
(``kv_offloading_size``), ``disk`` (``kv_offloading_dir`` only, in a temporary directory, so
loads read page files; the OS page cache is warm, as it is for a server that wrote them
recently). Each round draws a fresh prompt P and two fillers F, F' of the same length
(random ids): every engine runs P, then F and F' (which evict P's pages from the pool, into
the tier), then P again, timed (``max_tokens=1``: the time to the first token). Engines take
turns in a rotating order per round so load drift on a shared machine spreads over all
three. ``cached`` is the second P's ``num_cached_tokens``; ``same`` checks that its first
token equals recompute's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from benchmarks.common import bench_model, print_table
from pagefold import LLM, SamplingParams

ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def _gen(llm: LLM, prompt: list[int]):
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], ONE, use_tqdm=False)[0]
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen3_5")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pool", type=float, default=1.9, help="pool size in requests")
    args = ap.parse_args()
    model = str(bench_model(args.arch, args.hidden, args.layers))
    max_len = args.prompt + 16
    probe = LLM(model, max_model_len=max_len, kv_cache_memory="2GiB", warm_up=False)
    kvc = probe.engine.kv_config
    one = (probe.engine.kv.min_blocks_for(max_len) + 1) * kvc.layers_per_group * kvc.page_bytes
    vocab = probe.engine.hf_config.vocab_size
    del probe
    pool = int(args.pool * one)
    disk = tempfile.TemporaryDirectory(prefix="pagefold-offload-bench-")
    common = dict(max_model_len=max_len, kv_cache_memory=pool)
    engines = {
        "recompute": LLM(model, **common),
        "host": LLM(model, kv_offloading_size=4 * one / 2**30, **common),
        "disk": LLM(model, kv_offloading_dir=disk.name, kv_offloading_disk_size=8 * one,
                    **common),
    }
    rng = random.Random(0)
    ttft: dict[str, list[float]] = {k: [] for k in engines}
    cached: dict[str, list[int]] = {k: [] for k in engines}
    same: dict[str, list[bool]] = {k: [] for k in engines}
    names = list(engines)
    for r in range(args.rounds):
        p = [rng.randrange(5, vocab) for _ in range(args.prompt)]
        fillers = [[rng.randrange(5, vocab) for _ in range(args.prompt)] for _ in range(2)]
        first = {}
        for name in names[r % 3:] + names[: r % 3]:
            llm = engines[name]
            _gen(llm, p)
            for f in fillers:
                _gen(llm, f)
            secs, out = _gen(llm, p)
            ttft[name].append(secs)
            cached[name].append(out.num_cached_tokens)
            first[name] = out.outputs[0].token_ids
        for name in names:
            same[name].append(first[name] == first["recompute"])
    base = statistics.median(ttft["recompute"])
    cols = ["tier", "TTFT ms (median)", "vs recompute", "per round ms", "cached",
            "pages host/disk", "same"]
    rows = []
    for name, llm in engines.items():
        med = statistics.median(ttft[name])
        stats = getattr(llm.engine.offload, "stats", None)
        rows.append(dict(zip(cols, [
            name, f"{1000 * med:.0f}", f"{base / med:.2f}x",
            " ".join(f"{1000 * t:.0f}" for t in ttft[name]),
            f"{statistics.mean(cached[name]):.0f}/{args.prompt}",
            f"{stats.loads_host}/{stats.loads_disk}" if stats else "-",
            "yes" if all(same[name]) else "NO"])))
    print(f"{args.arch} hidden {args.hidden} x {args.layers} layers, prompt {args.prompt} "
          f"tokens, pool {pool / 2**20:.1f} MiB (one request {one / 2**20:.1f} MiB)")
    print_table(rows, cols)
    for llm in engines.values():
        llm.engine.shutdown()
    disk.cleanup()


if __name__ == "__main__":
    main()
