"""Offline prefix-caching benchmark: the same traces with the cache ON and OFF, one run.

    python -m benchmarks.prefix_cache [--arch qwen3_5|qwen3|nemotron_h] [--scale 0.25]

Traces (token ids drawn at random, so only the intended prefixes are shared):
  * ``prefix{8,16,500}/{seq,batch}``: one shared prefix of 8 tokens (under a block), 16 (one
    block) or 500 (a system prompt), each followed by a distinct 20-60 token question;
    submitted one request after another (``seq``: reuse from the 2nd request on) or as one
    batch (``batch``: reuse depends on in-flight prefix sharing).
  * ``conv KxT``: K conversations of T turns; turn t+1 = turn t's prompt + its answer + a new
    20-60 token user message; each turn of all K conversations is submitted as one batch.
  * ``split 1500/700``: one batch of requests sharing 1500 tokens, each with 700 of its own.
  * ``random``: no shared prefix (N prompts x 256 in, 64-128 out): the cache can only cost.
    Run ``--random-repeats`` times with fresh prompts, alternating which engine goes first
    (off-on, on-off, ...) so that load drift on a shared machine cancels out.

Both engines (``enable_prefix_caching`` True / False) live side by side and every trace runs on
OFF then ON (alternating for repeats), with identical prompts. Requests go through
``LLM.add_request`` + ``LLM.step`` so that time to first token (submission to the step that
returned the request's first token) is measured per request. Every request uses greedy
sampling with ``ignore_eos`` so the output token counts of ON and OFF are the same.

Columns: ``hit rate`` = cached prompt tokens / prompt tokens (from each request's
``num_cached_tokens``), ``reqs hit`` = requests with any cached token, ``ckpts`` = state
checkpoints held in the pool after the trace (hybrids), ``cpu s`` = this process's CPU seconds,
``on/off tok/s`` = output throughput ratio, ``on/off cpu`` = CPU seconds ratio (steadier than
wall time on a shared machine; above 1 = the cache cost compute), ``TTFT off/on`` = how many
times shorter the mean TTFT is with the cache, ``match`` = fraction of requests whose greedy
output is the same with the cache on and off.

``--with-cut`` adds a third engine, ``cut``: the cache on with the old way of taking hybrid
state checkpoints (prefill chunks cut at every checkpoint target,
``state_checkpoints_in_kernel=False``), run interleaved with the other two, so the cost of
the cuts and what capturing inside the kernels saves show side by side.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks.common import bench_model, print_table, torch_threads

COLUMNS = ["trace", "cache", "reqs", "prompt tok", "hit rate", "reqs hit", "ckpts", "TTFT ms",
           "seconds", "cpu s", "out tok/s", "on/off tok/s", "on/off cpu", "TTFT off/on",
           "match"]


@dataclass
class Rec:
    """One finished request: what it asked, what it got, and when."""

    prompt_len: int
    t_submit: float
    t_first: float | None = None
    t_done: float | None = None
    cached: int = 0
    tokens: list[int] = field(default_factory=list)


@dataclass
class Trace:
    """A named workload: ``rounds[i](llm)`` submits round i's requests and returns their records.

    Every round is deterministic in its inputs except where it feeds back the engine's own
    answers (conversations), so ON and OFF see the same prompts while their outputs agree.
    """

    name: str
    rounds: list[Callable[[object], list[Rec]]]


# ---------------------------------------------------------------------------- driving the engine
def drive(llm, prompts: list[list[int]], max_tokens: list[int]) -> list[Rec]:
    """Submit ``prompts`` together and step the engine until all finish; records in input order."""
    from pagefold import SamplingParams

    recs: dict[str, Rec] = {}
    order = []
    for p, m in zip(prompts, max_tokens):
        sp = SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        rid = llm.add_request({"prompt_token_ids": p}, sp)
        recs[rid] = Rec(len(p), t)
        order.append(rid)
    pending = set(order)
    while pending:
        outs = llm.step()
        now = time.perf_counter()
        if not outs and not llm.engine.has_unfinished():
            raise RuntimeError(f"engine went idle with {len(pending)} requests unfinished")
        for o in outs:
            r = recs.get(o.request_id)
            if r is None:
                continue
            if r.t_first is None and o.outputs[0].token_ids:
                r.t_first = now
            if o.finished:
                r.t_done, r.cached = now, o.num_cached_tokens
                r.tokens = list(o.outputs[0].token_ids)
                pending.discard(o.request_id)
    return [recs[i] for i in order]


def sequential(llm, prompts: list[list[int]], max_tokens: list[int]) -> list[Rec]:
    """One request at a time: each is submitted when the previous one finished."""
    return [r for p, m in zip(prompts, max_tokens) for r in drive(llm, [p], [m])]


# ---------------------------------------------------------------------------- traces
def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(5, vocab) for _ in range(n)]  # ids 0..4 are special tokens


def shared_prefix_trace(prefix_len: int, n: int, mode: str, out_len: int, vocab: int,
                        seed: int) -> Trace:
    """``n`` prompts = one ``prefix_len`` prefix + a 20-60 token question; ``mode`` seq|batch."""
    rng = random.Random(seed)
    prefix = _ids(rng, prefix_len, vocab)
    prompts = [prefix + _ids(rng, rng.randint(20, 60), vocab) for _ in range(n)]
    run = sequential if mode == "seq" else drive
    return Trace(f"prefix{prefix_len}/{mode}",
                 [lambda llm: run(llm, prompts, [out_len] * n)])


def conversation_trace(k: int, turns: int, answer_len: int, vocab: int, seed: int) -> Trace:
    """Turn 1 is a 100-200 token opening message; later user messages are 20-60 tokens."""
    rng = random.Random(seed)
    first = [_ids(rng, rng.randint(100, 200), vocab) for _ in range(k)]
    msgs = [[_ids(rng, rng.randint(20, 60), vocab) for _ in range(k)] for _ in range(turns - 1)]

    def run(llm) -> list[Rec]:
        prompts, recs = first, []
        for t in range(turns):
            out = drive(llm, prompts, [answer_len] * k)
            recs += out
            if t + 1 < turns:
                prompts = [p + r.tokens + m for p, r, m in zip(prompts, out, msgs[t])]
        return recs

    return Trace(f"conv {k}x{turns}", [run])


def split_trace(shared: int, unique: int, n: int, out_len: int, vocab: int, seed: int) -> Trace:
    """One batch of ``n`` prompts: the same ``shared`` tokens, then ``unique`` of their own."""
    rng = random.Random(seed)
    prefix = _ids(rng, shared, vocab)
    prompts = [prefix + _ids(rng, unique, vocab) for _ in range(n)]
    return Trace(f"split {shared}/{unique}", [lambda llm: drive(llm, prompts, [out_len] * n)])


def random_trace(n: int, in_len: int, out_range: tuple[int, int], vocab: int, seed: int,
                 repeats: int) -> Trace:
    """``repeats`` rounds of ``n`` unrelated prompts (fresh ones each round: no reuse)."""
    rounds = []
    for i in range(repeats):
        rng = random.Random(seed * 1000 + i)
        prompts = [_ids(rng, in_len, vocab) for _ in range(n)]
        outs = [rng.randint(*out_range) for _ in range(n)]
        rounds.append(lambda llm, p=prompts, o=outs: drive(llm, p, o))
    return Trace("random", rounds)


def build_traces(args, vocab: int) -> list[Trace]:
    """The traces ``--traces`` selects, sized by the options and ``--scale`` (min 2 each)."""
    def n(x: int, lo: int = 2) -> int:
        return max(lo, round(x * args.scale))

    wanted = set(args.traces)
    traces: list[Trace] = []
    seed = args.seed * 100
    if "prefix" in wanted:
        for i, plen in enumerate(args.prefix_lens):
            for j, mode in enumerate(("seq", "batch")):
                traces.append(shared_prefix_trace(plen, n(args.prefix_requests), mode,
                                                  args.prefix_output_len, vocab,
                                                  seed + 10 * i + j))
    if "conv" in wanted:
        traces.append(conversation_trace(n(args.conversations), args.turns, args.answer_len,
                                         vocab, seed + 50))
    if "split" in wanted:
        shared, unique = args.split_lens
        traces.append(split_trace(shared, unique, n(args.split_requests),
                                  args.split_output_len, vocab, seed + 60))
    if "random" in wanted:
        traces.append(random_trace(n(args.random_requests), args.random_input_len,
                                   (args.random_output_len[0], args.random_output_len[-1]),
                                   vocab, seed + 70, args.random_repeats))
    return traces


# ---------------------------------------------------------------------------- measuring
def run_trace(trace: Trace,
              engines: dict[str, object]) -> dict[str, tuple[list[Rec], float, float]]:
    """Every round on both engines (OFF first on even rounds): records, wall and CPU seconds.

    CPU seconds (this process, all threads) barely move when other processes load the machine,
    so their ratio is the steadier measure of what the cache costs in compute.
    """
    got: dict[str, tuple[list[Rec], float, float]] = {k: ([], 0.0, 0.0) for k in engines}
    for i, rnd in enumerate(trace.rounds):
        order = list(engines) if i % 2 == 0 else list(reversed(engines))
        for key in order:
            t, c = time.perf_counter(), time.process_time()
            recs = rnd(engines[key])
            dt, dc = time.perf_counter() - t, time.process_time() - c
            recs0, t0, c0 = got[key]
            got[key] = (recs0 + recs, t0 + dt, c0 + dc)
    return got


def summarize(name: str, key: str, recs: list[Rec], seconds: float, cpu: float, llm) -> dict:
    prompt_tok = sum(r.prompt_len for r in recs)
    ttft = [r.t_first - r.t_submit for r in recs]
    n_ckpt = llm.engine.kv.pool.checkpoint_stats()[0] if key != "off" else None
    return {"trace": name, "cache": key, "reqs": len(recs), "prompt tok": prompt_tok,
            "hit rate": sum(r.cached for r in recs) / prompt_tok,
            "reqs hit": sum(r.cached > 0 for r in recs), "ckpts": n_ckpt,
            "TTFT ms": 1000 * sum(ttft) / len(ttft), "seconds": seconds, "cpu s": cpu,
            "out tok/s": sum(len(r.tokens) for r in recs) / seconds}


def compare(on: dict, off: dict, on_recs: list[Rec], off_recs: list[Rec]) -> None:
    """Fill the ON row's ratio columns (measured in this run, on the same prompts)."""
    on["on/off tok/s"] = on["out tok/s"] / off["out tok/s"]
    on["on/off cpu"] = on["cpu s"] / off["cpu s"]
    on["TTFT off/on"] = off["TTFT ms"] / on["TTFT ms"]
    on["match"] = sum(a.tokens == b.tokens for a, b in zip(on_recs, off_recs)) / len(on_recs)


def make_engines(model: str, args) -> dict[str, object]:
    from pagefold import LLM, SamplingParams

    engines = {}
    for key in ("off", "on", "cut") if args.with_cut else ("off", "on"):
        llm = LLM(model, dtype=args.dtype, max_model_len=args.max_model_len,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_num_seqs=args.max_num_seqs, kv_cache_memory=args.kv_cache_memory,
                  enable_prefix_caching=key != "off", seed=args.seed,
                  state_checkpoints_in_kernel=key != "cut")
        # Warm-up on prompts no trace shares (token id 5 repeated never occurs by chance).
        llm.generate([{"prompt_token_ids": [5] * 40}, {"prompt_token_ids": [6] * 70}],
                     SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
        engines[key] = llm
    return engines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="qwen3_5", help="tiny model to build (qwen3_5, qwen3, ...)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--model", default=None, help="model dir (default: build a tiny one)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiplies every request/conversation count (not the lengths)")
    p.add_argument("--traces", nargs="+", default=["prefix", "conv", "split", "random"],
                   choices=["prefix", "conv", "split", "random"])
    p.add_argument("--prefix-lens", type=int, nargs="+", default=[8, 16, 500])
    p.add_argument("--prefix-requests", type=int, default=16)
    p.add_argument("--prefix-output-len", type=int, default=16)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--answer-len", type=int, default=32)
    p.add_argument("--split-lens", type=int, nargs=2, default=[1500, 700],
                   metavar=("SHARED", "UNIQUE"))
    p.add_argument("--split-requests", type=int, default=64)
    p.add_argument("--split-output-len", type=int, default=8)
    p.add_argument("--random-requests", type=int, default=64)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, nargs="+", default=[64, 128],
                   help="L or MIN MAX")
    p.add_argument("--random-repeats", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="float32 (default) makes 'match' an exactness check; in bfloat16 a "
                   "different prefill chunking alone can flip a greedy token")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-cache-memory", default="512MiB", help="per engine (two are alive)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for this run (restored after); 1 is far steadier on a "
                   "machine whose cores other processes share")
    p.add_argument("--with-cut", action="store_true",
                   help="also run the cache on with chunks cut at checkpoint targets")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no per-trace progress lines")
    args = p.parse_args(argv)
    if args.scale <= 0:
        p.error("--scale must be positive")
    if args.turns < 1 or args.random_repeats < 1:
        p.error("--turns and --random-repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the traces; prints and returns the table rows (an OFF and an ON row per trace)."""
    args = parse_args(argv)
    with torch_threads(args.threads):
        return _main(args)


def _main(args: argparse.Namespace) -> list[dict]:
    import torch
    from transformers import AutoConfig

    model = args.model or str(bench_model(args.arch, args.hidden, args.layers))
    vocab = AutoConfig.from_pretrained(model).get_text_config().vocab_size
    engines = make_engines(model, args)
    stats = engines["on"].engine.kv.stats
    base = (stats.hits, stats.queries, stats.requests_hit, stats.requests)  # the warm-up's
    rows: list[dict] = []
    start = time.perf_counter()
    for trace in build_traces(args, vocab):
        got = run_trace(trace, engines)
        off = summarize(trace.name, "off", *got["off"], engines["off"])
        on = summarize(trace.name, "on", *got["on"], engines["on"])
        compare(on, off, got["on"][0], got["off"][0])
        rows += [off, on]
        if "cut" in got:
            cut = summarize(trace.name, "cut", *got["cut"], engines["cut"])
            compare(cut, off, got["cut"][0], got["off"][0])
            rows.append(cut)
        if not args.quiet:
            print(f"[{time.perf_counter() - start:6.1f}s] {trace.name}: hit rate "
                  f"{on['hit rate']:.2f}, on/off tok/s {on['on/off tok/s']:.2f}", flush=True)
    for llm in engines.values():
        llm.engine.kv.check_whole()  # no trace leaked a block, cache on or off
    hits, queries, req_hit, reqs = (x - y for x, y in zip(
        (stats.hits, stats.queries, stats.requests_hit, stats.requests), base))
    print(f"\nmodel {model} ({args.dtype}), scale {args.scale}, torch threads "
          f"{torch.get_num_threads()}, total {time.perf_counter() - start:.1f}s; engine ON "
          f"(kv.stats, admissions incl. re-admissions): {hits}/{queries} prompt tokens cached, "
          f"{req_hit}/{reqs} requests hit, "
          f"{engines['on'].engine.kv.pool.stats.checkpoint_hits} checkpoint hits, "
          f"{engines['on'].engine.scheduler.num_preemptions} preemptions")
    print_table(rows, COLUMNS)
    return rows


if __name__ == "__main__":
    main()
