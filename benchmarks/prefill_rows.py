"""Prefill speed when prompt lengths vary: oneDNN's per-shape primitives, rows padded or not.

oneDNN makes (JIT-compiles) a primitive for each product shape, rows included, and caches it;
making one costs more than the product (``pagefold/csrc/gemm.py``). A prefill of a new length
(or an MoE expert's new token count) is a new shape for every product of the step unless the
rows are padded to a few sizes (``gemm.bucket_rows``). Each worker (a subprocess, one after
the other, rounds in turn) runs, one prompt at a time with ``max_tokens=1``:

* ``cold``: the first 512-token prompt the engine sees (after a 16-token warm-up request);
* ``same``: that prompt again (every shape made);
* ``lengths 1`` / ``lengths 2``: two passes over the same 8 prompts of random lengths
  300-512 and random tokens (the second pass: every shape of the first made);
* ``fresh``: 8 more prompts of new random lengths.

with the rows padded (``buckets``, the default) and unpadded (``exact``: ``bucket_rows`` made
the identity in the worker). Figures are prompt tokens / time to first token, medians per
phase, and the ``exact`` / ``buckets`` ratio of each.

    python -m benchmarks.prefill_rows --models qwen3_5-h256-l4 qwen3_next-h256-l4 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time

from benchmarks.common import print_table

PHASES = ("cold", "same", "lengths 1", "lengths 2", "fresh")


def _model_path(name: str) -> str:
    from benchmarks.llama_compare import hf_model

    return str(hf_model(name))


def worker(spec: dict) -> dict:
    import torch

    from pagefold import LLM, SamplingParams
    from pagefold.csrc import gemm

    torch.set_num_threads(spec["threads"])
    if spec["mode"] == "exact":
        gemm.bucket_rows = lambda m: m  # every row count its own shape
    llm = LLM(spec["path"], dtype="bfloat16", max_model_len=1024, kv_cache_memory=1 << 30,
              seed=0, enable_prefix_caching=False)
    rng = random.Random(spec["seed"])
    vocab = spec["vocab"]

    def prompt(n: int) -> list[int]:
        return [rng.randrange(5, vocab) for _ in range(n)]

    def rate(ids: list[int]) -> float:
        llm.add_request({"prompt_token_ids": ids},
                        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        t0 = time.perf_counter()
        while llm.engine.has_unfinished():
            llm.step()
        return len(ids) / (time.perf_counter() - t0)

    rate(prompt(16))
    first = prompt(512)
    varied = [prompt(rng.randint(300, 512)) for _ in range(8)]
    out = {"cold": rate(first), "same": rate(first)}
    out["lengths 1"] = statistics.median(rate(p) for p in varied)
    out["lengths 2"] = statistics.median(rate(p) for p in varied)
    out["fresh"] = statistics.median(rate(prompt(rng.randint(300, 512))) for _ in range(8))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["qwen3_5-h256-l4", "qwen3_next-h256-l4"],
                   help="llama_compare's model names (built once into the cache)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))))
        return
    from benchmarks.llama_compare import VOCAB

    rows = []
    for name in args.models:
        path = _model_path(name)
        got: dict[str, list[dict]] = {"buckets": [], "exact": []}
        for r in range(args.rounds):
            for mode in ("buckets", "exact") if r % 2 == 0 else ("exact", "buckets"):
                spec = {"path": path, "mode": mode, "threads": args.threads, "seed": r,
                        "vocab": VOCAB}
                proc = subprocess.run([sys.executable, "-m", "benchmarks.prefill_rows",
                                       "--worker", json.dumps(spec)],
                                      capture_output=True, text=True, check=True)
                line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
                got[mode].append(json.loads(line[len("RESULT "):]))
                print(f"{name} round {r + 1} {mode}: " + ", ".join(
                    f"{k} {v:,.0f}" for k, v in got[mode][-1].items()), flush=True)
        for mode in ("buckets", "exact"):
            row = {"model": name, "rows": mode}
            for ph in PHASES:
                row[ph] = statistics.median(g[ph] for g in got[mode])
            rows.append(row)
        rows.append({"model": name, "rows": "exact / buckets", **{
            ph: statistics.median(e[ph] / b[ph] for e, b in zip(got["exact"], got["buckets"],
                                                                 strict=True))
            for ph in PHASES}})
    print()
    print("prompt tok/s (median of rounds), one prompt at a time")
    print_table(rows, ["model", "rows", *PHASES])


if __name__ == "__main__":
    main()
