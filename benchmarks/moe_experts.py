"""MoE experts' many-token steps: the grouped path against the per-expert loop, in one run.

    python -m benchmarks.moe_experts                  # the routed experts alone, per shape
    python -m benchmarks.moe_experts --engine         # + a 64-expert model's throughput

Kernel table: one bf16 ``MoEExperts`` layer per (experts, hidden, expert width, top-k) with
random weights and routing, ``T`` tokens a step (past the few-token path's rows: decode batches
of 64, prefill chunks), timed with the grouped path (``layers/moe_rows.py``) and with the
general per-expert loop it replaces, and with the AMX tile GEMV limited to runs of 32 (longer
runs on oneDNN, as before the tile product's blocked path: ``tile runs`` is that time over the
grouped path's), alternating calls so the machine's noise hits all; best of ``--reps``.
``--engine``: a random Qwen3-Next-style model (hidden 512, 4 layers, 64 experts of 256,
top 8) through ``LLM.generate``, 64 requests of 256 -> 64 greedy tokens, the two paths in turn
(same process, same weights, fresh prompts each round), output tokens/s.
"""

from __future__ import annotations

import argparse
import random
import time

from benchmarks.common import bench_model, print_table, torch_threads

SHAPES = [  # (experts, hidden, expert intermediate, top-k)
    (64, 512, 256, 8),
    (128, 1024, 384, 8),
    (128, 2048, 768, 8),  # Qwen3-30B-A3B's expert layout
]
TOKENS = (64, 256, 2048)


def _layer(e: int, h: int, i: int):
    import torch

    from pagefold.layers.moe import MoEExperts

    m = MoEExperts(e, h, i)
    with torch.no_grad():
        m.gate_up_proj.normal_(0, 0.05)
        m.down_proj.normal_(0, 0.05)
    return m.bfloat16()


class _Paths:
    """Switches a module's many-token path between the grouped one and the loop; ``short``:
    the grouped path with the AMX tile GEMV limited to runs of 32 (longer runs on oneDNN)."""

    def __init__(self) -> None:
        from pagefold.layers import moe_rows
        from pagefold.layers.moe import MoEExperts

        self.cls, self.real = MoEExperts, MoEExperts._grouped_ok
        self.rows, self.max_run = moe_rows, moe_rows.AMX_MAX_RUN

    def set(self, grouped: bool, short: bool = False) -> None:
        self.cls._grouped_ok = self.real if grouped else (lambda self, *a: False)
        self.rows.AMX_MAX_RUN = self.rows.AMX_NARROW_RUN if short else self.max_run


def kernel_table(reps: int) -> list[dict]:
    import torch

    paths = _Paths()
    rows = []
    for e, h, i, k in SHAPES:
        m = _layer(e, h, i)
        for t in TOKENS:
            g = torch.Generator().manual_seed(t)
            x = torch.randn(t, h, generator=g).bfloat16()
            w, idx = torch.randn(t, e, generator=g).softmax(-1).topk(k, -1)
            w = (w / w.sum(-1, keepdim=True)).bfloat16()
            ways = [(True, False), (False, False), (True, True)]  # grouped, loop, short
            best = dict.fromkeys(ways, float("inf"))
            for way in ways:  # warm-up: oneDNN makes its primitives
                paths.set(*way)
                m(x, idx, w)
            for _ in range(reps):
                for way in ways:
                    paths.set(*way)
                    t0 = time.perf_counter()
                    m(x, idx, w)
                    best[way] = min(best[way], time.perf_counter() - t0)
            paths.set(True)
            g, loop, short = (best[way] for way in ways)
            rows.append({"experts": f"{e} x {h}x{i} top {k}", "tokens": t,
                         "loop ms": loop * 1e3, "grouped ms": g * 1e3,
                         "speed-up": loop / g, "runs > 32 on oneDNN ms": short * 1e3,
                         "tile runs": short / g})
        del m
    return rows


def engine_table(rounds: int) -> list[dict]:
    from pagefold import LLM, SamplingParams

    model = bench_model("qwen3_next", 512, 4, moe_intermediate_size=256, num_experts=64,
                        num_experts_per_tok=8)
    paths = _Paths()
    llm = LLM(str(model), dtype="bfloat16", max_model_len=400, kv_cache_memory=2 << 30)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    vocab = 500  # the bench model's vocabulary is 512 tokens

    def prompts(seed: int) -> list[dict]:
        r = random.Random(seed)
        return [{"prompt_token_ids": [r.randrange(5, vocab) for _ in range(256)]}
                for _ in range(64)]

    llm.generate(prompts(999)[:8], params, use_tqdm=False)  # warm-up
    out: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for grouped in ((True, False) if r % 2 == 0 else (False, True)):
            paths.set(grouped)
            t0 = time.perf_counter()
            llm.generate(prompts(r * 2 + grouped), params, use_tqdm=False)
            out[grouped].append(64 * 64 / (time.perf_counter() - t0))
    paths.set(True)
    med = {g: sorted(v)[len(v) // 2] for g, v in out.items()}
    return [{"model": "qwen3_next h512 l4, 64 x 256x512 top 8", "workload": "64 x 256 -> 64",
             "loop tok/s": med[False], "grouped tok/s": med[True],
             "speed-up": med[True] / med[False]}]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--engine", action="store_true", help="also the 64-expert model's throughput")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    with torch_threads(args.threads):
        print_table(kernel_table(args.reps),
                    ["experts", "tokens", "loop ms", "grouped ms", "speed-up",
                     "runs > 32 on oneDNN ms", "tile runs"])
        if args.engine:
            print()
            print_table(engine_table(args.rounds),
                        ["model", "workload", "loop tok/s", "grouped tok/s", "speed-up"])


if __name__ == "__main__":
    main()
