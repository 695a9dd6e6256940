"""Time to first token with prefix caching ON vs OFF on zero-overlap traffic (hybrids).

    python -m benchmarks.ttft_zero_overlap                       # GDN + Mamba-2 hybrids, bf16
    python -m benchmarks.ttft_zero_overlap --archs nemotron_h --prompts 8 --profile

With no shared prefix the cache can only cost: the hybrids still take state checkpoints at
their targets (the last block boundary of the prompt, 3 blocks before it, every
``state_checkpoint_interval`` tokens), captured inside the state layers' kernels during the
prefill step. This measures what that costs in TTFT.

Per model (``--archs``: ``qwen3_5`` = Qwen3.5-style Gated DeltaNet hybrid, ``nemotron_h`` =
Nemotron-H-style Mamba-2 hybrid; random weights, ``--hidden`` / ``--layers``, CPU default
kernels) two engines live side by side, ``off`` and ``on``. ``--prompts`` distinct random
prompts of ``--in-len`` MIN MAX tokens are sent one at a time (batch 1) to both engines,
alternating which engine goes first; the first ``--long-out`` of them ask for ``--out-len``
tokens, the rest for 1. Every prompt is new to both engines (token ids drawn at random);
each is preceded by an unmeasured request of the same length (oneDNN builds its GEMM
primitives once per new shape, for both engines at once).

Columns: ``TTFT ms`` = mean wall time from submission to the step that returned the first
token, ``CPU ms`` = this process's CPU time over the same span (steadier than wall time on a
machine other processes load), ``off/on`` ratios of those means (1.0 = caching costs nothing
in TTFT; the issue's target is >= 0.97), ``pair med`` = the median over prompts of the
per-prompt CPU TTFT off/on (the two engines ran that prompt back to back, so a load spike
on the machine spoils one pair, not the mean), ``e2e off/on`` = the same for the whole request,
``ckpts`` = state checkpoints the ON engine held after the run, ``hits`` = requests that found
any cached token (0 here by construction), ``match`` = fraction of requests whose greedy
tokens are equal ON and OFF.

``--profile``: also a cProfile of the ON engine over the prompts (top functions by own time).
``--kernels``: instead, the capture cost inside the torch chunked SSD / GDN kernels alone
(``captures/plain`` = CPU time with the ON engine's captures over without, one sequence).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import bench_model, print_table, torch_threads

COLUMNS = ["model", "reqs", "prompt tok", "TTFT ms off", "TTFT ms on", "TTFT off/on",
           "CPU ms off", "CPU ms on", "CPU off/on", "pair med", "e2e off/on", "ckpts", "hits",
           "match"]


@dataclass
class Timing:
    """One request on one engine: wall and CPU seconds to the first token and to the end."""

    ttft: float = 0.0
    ttft_cpu: float = 0.0
    e2e: float = 0.0
    cached: int = 0
    tokens: list[int] = field(default_factory=list)


def one_request(llm, prompt: list[int], max_tokens: int) -> Timing:
    """Submit one prompt and step the engine until it finishes (batch 1)."""
    from pagefold import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    rec = Timing()
    t0, c0 = time.perf_counter(), time.process_time()
    rid = llm.add_request({"prompt_token_ids": prompt}, sp)
    first = False
    while True:
        outs = llm.step()
        now, cnow = time.perf_counter(), time.process_time()
        if not outs and not llm.engine.has_unfinished():
            raise RuntimeError("engine went idle before the request finished")
        for o in outs:
            if o.request_id != rid:
                continue
            if not first and o.outputs[0].token_ids:
                first = True
                rec.ttft, rec.ttft_cpu = now - t0, cnow - c0
            if o.finished:
                rec.e2e, rec.cached = now - t0, o.num_cached_tokens
                rec.tokens = list(o.outputs[0].token_ids)
                return rec


def make_engine(model: str, args: argparse.Namespace, caching: bool):
    from pagefold import LLM, SamplingParams

    llm = LLM(model, dtype=args.dtype, max_model_len=args.max_model_len,
              kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=caching,
              seed=args.seed)
    # Warm-up on a prompt no request shares (token id 5 repeated never occurs by chance), as
    # long as the longest request so that no first-use cost lands on a measured one.
    llm.generate([{"prompt_token_ids": [5] * args.in_len[1]}],
                 SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    return llm


def run_model(arch: str, args: argparse.Namespace, model: str | None = None) -> dict:
    """Both engines over one model (built from ``arch`` unless ``model`` is a directory)."""
    from transformers import AutoConfig

    label = Path(model).name if model else f"{arch}-h{args.hidden}-l{args.layers}"
    model = model or str(bench_model(arch, args.hidden, args.layers))
    vocab = AutoConfig.from_pretrained(model).get_text_config().vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(6, vocab) for _ in range(rng.randint(*args.in_len))]
               for _ in range(args.prompts)]
    outs = [args.out_len if i < args.long_out else 1 for i in range(args.prompts)]
    engines = {"off": make_engine(model, args, False), "on": make_engine(model, args, True)}
    got: dict[str, list[Timing]] = {"off": [], "on": []}
    for i, (p, m) in enumerate(zip(prompts, outs, strict=True)):
        order = ("off", "on") if i % 2 == 0 else ("on", "off")
        # A prompt length never seen makes oneDNN build new GEMM primitives (process-wide, so
        # for both engines): one unmeasured request of that length first, so neither engine
        # pays it (its first token differs, so it shares no block with the measured prompt).
        one_request(engines[order[0]], [5, *p[1:]], 1)
        for key in order:
            got[key].append(one_request(engines[key], p, m))
    if args.profile:
        profile_engine(engines["on"], prompts, outs, args.profile_top)

    def mean(key: str, attr: str) -> float:
        return sum(getattr(r, attr) for r in got[key]) / len(got[key])

    off_t, on_t = mean("off", "ttft"), mean("on", "ttft")
    off_c, on_c = mean("off", "ttft_cpu"), mean("on", "ttft_cpu")
    row = {"model": label, "reqs": len(prompts),
           "prompt tok": sum(map(len, prompts)),
           "TTFT ms off": 1000 * off_t, "TTFT ms on": 1000 * on_t, "TTFT off/on": off_t / on_t,
           "CPU ms off": 1000 * off_c, "CPU ms on": 1000 * on_c, "CPU off/on": off_c / on_c,
           "pair med": statistics.median(a.ttft_cpu / b.ttft_cpu
                                         for a, b in zip(got["off"], got["on"], strict=True)),
           "e2e off/on": mean("off", "e2e") / mean("on", "e2e"),
           "ckpts": engines["on"].engine.kv.pool.checkpoint_stats()[0],
           "hits": sum(r.cached > 0 for r in got["on"]),
           "match": sum(a.tokens == b.tokens for a, b in zip(got["on"], got["off"], strict=True))
           / len(prompts)}
    del engines
    return row


def profile_engine(llm, prompts: list[list[int]], outs: list[int], top: int) -> None:
    """cProfile the engine over fresh copies of the prompts (one token changed, so no hits)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for p, m in zip(prompts, outs, strict=True):
        one_request(llm, [5, *p[1:]], m)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def kernel_overhead(args: argparse.Namespace) -> list[dict]:
    """The capture cost inside the torch chunked kernels alone: one ``--kernel-len``-token
    sequence (bf16 inputs, float32 states, Nemotron-H / Qwen3.5-like head sizes) through
    ``ssd_chunked`` and ``gdn_chunked`` with and without the captures an ON engine asks for
    (every 256 tokens, the last block boundary and 3 blocks before it); interleaved repeats,
    best CPU time of each."""
    import torch

    from pagefold.ops.gdn.reference import gdn_chunked
    from pagefold.ops.ssd.reference import ssd_chunked

    n, g = args.kernel_len, torch.Generator().manual_seed(args.seed)
    last = (n - 1) // 16 * 16
    after = torch.tensor(sorted({*range(256, n, 256), last, last - 48})) - 1
    h, p, grp, st = 16, 64, 2, 64  # SSD: heads, head dim, groups, state size
    ssd_in = (torch.randn(n, h, p, generator=g).bfloat16(), torch.randn(n, h, generator=g),
              -(torch.rand(h, generator=g) + 0.05),
              torch.randn(n, grp, st, generator=g).bfloat16(),
              torch.randn(n, grp, st, generator=g).bfloat16(), torch.randn(h, generator=g),
              torch.zeros(1, h, p, st), torch.tensor([0, n]))
    hv, dk = 8, 64  # GDN: value heads (key heads alike here), head dims
    gdn_in = (torch.randn(n, hv, dk, generator=g).bfloat16(),
              torch.randn(n, hv, dk, generator=g).bfloat16(),
              torch.randn(n, hv, dk, generator=g).bfloat16(),
              -torch.rand(n, hv, generator=g) * 0.1, torch.rand(n, hv, generator=g),
              torch.zeros(1, hv, dk, dk), torch.tensor([0, n]))

    def ssd(cap: bool) -> None:
        out = torch.empty(len(after), h, p, st)
        ssd_chunked(*ssd_in, dt_bias=None, capture=(after, out) if cap else None)

    def gdn(cap: bool) -> None:
        out = torch.empty(len(after), hv, dk, dk)
        gdn_chunked(*gdn_in, capture=(after, out) if cap else None)

    rows = []
    for name, fn in (("ssd_chunked", ssd), ("gdn_chunked", gdn)):
        best = {False: math.inf, True: math.inf}
        for _ in range(args.kernel_repeats):
            for cap in (False, True):
                c = time.process_time()
                fn(cap)
                best[cap] = min(best[cap], time.process_time() - c)
        rows.append({"kernel": name, "tokens": n, "captures": len(after),
                     "ms plain": 1000 * best[False], "ms captures": 1000 * best[True],
                     "captures/plain": best[True] / best[False]})
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", nargs="+", default=["qwen3_5", "nemotron_h"])
    p.add_argument("--models", nargs="+", default=None,
                   help="model directories to run instead of building --archs")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--in-len", type=int, nargs=2, default=[1000, 2000], metavar=("MIN", "MAX"))
    p.add_argument("--long-out", type=int, default=4, help="requests that decode --out-len")
    p.add_argument("--out-len", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-memory", default="256MiB", help="per engine (two are alive)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1 is far steadier on a machine other processes share)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--kernels", action="store_true",
                   help="instead: the capture cost of the torch chunked SSD / GDN kernels")
    p.add_argument("--kernel-len", type=int, default=1500)
    p.add_argument("--kernel-repeats", type=int, default=15)
    p.add_argument("--profile-top", type=int, default=30)
    args = p.parse_args(argv)
    if args.in_len[0] < 1 or args.in_len[1] < args.in_len[0]:
        p.error("--in-len needs 1 <= MIN <= MAX")
    if args.prompts < 1:
        p.error("--prompts must be at least 1")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    """Run every model; prints and returns the table rows (one per model)."""
    args = parse_args(argv)
    with torch_threads(args.threads):
        if args.kernels:
            rows = kernel_overhead(args)
            print_table(rows, list(rows[0]))
            return rows
        rows = ([run_model("", args, m) for m in args.models] if args.models
                else [run_model(arch, args) for arch in args.archs])
    print_table(rows, COLUMNS)
    return rows


if __name__ == "__main__":
    main()
