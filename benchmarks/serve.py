"""Online serving benchmark against any OpenAI-compatible server (pagefold, vLLM, ...).

    python -m benchmarks.serve --base-url http://127.0.0.1:8000/v1 --model NAME \\
        [--dataset random|prefix-repetition] [--num-prompts 200] [--input-len 128] \\
        [--output-len 64] [--request-rate 8 | --max-concurrency 16] \\
        [--goodput ttft:500 tpot:50] [--result-json out.json]

Every request streams (``stream_options.include_usage`` gives the exact output token count;
without it the content chunks are counted). Arrivals are Poisson at ``--request-rate``
requests/s (``inf``: all at once), optionally capped at ``--max-concurrency`` in flight.

Reported: request and token throughput, goodput (requests/s meeting every SLO given with
``--goodput``, in ms), and mean / median / p99 of TTFT (time to first token), TPOT (time per
output token after the first), ITL (gaps between content chunks) and E2E latency.

Prompts are random words (about one token each for BPE vocabularies), or with
``--tokenizer DIR`` decoded random token ids, or with ``--token-ids`` raw token id lists
(exact lengths; needs a server that accepts token prompts, as pagefold and vLLM do).
``prefix-repetition`` prepends one of ``--num-prefixes`` shared prefixes of
``--prefix-len`` to each prompt (a prefix-caching workload).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field

import httpx

_WORDS = ("time year people way day man thing woman life child world school state family "
          "student group country problem hand part place case week company system program "
          "question work government number night point home water room mother area money "
          "story fact month lot right study book eye job word business issue side kind head "
          "house service friend father power hour game line end member law car city name "
          "team minute idea body information back parent face level office door health art "
          "war history party result change morning reason research girl guy moment air").split()


@dataclass
class RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# --------------------------------------------------------------------------- workload
def _lengths(mean: int, ratio: float, n: int, rng: random.Random) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def make_prompts(args: argparse.Namespace) -> list[tuple[str | list[int], int, int]]:
    """``(prompt, prompt length estimate, max_tokens)`` per request."""
    rng = random.Random(args.seed)
    tok = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = len(tok) if tok is not None else args.vocab_size

    def piece(n: int):
        if args.token_ids:
            return [rng.randrange(args.min_token_id, vocab) for _ in range(n)]
        if tok is not None:
            return tok.decode([rng.randrange(args.min_token_id, vocab) for _ in range(n)])
        return " ".join(rng.choice(_WORDS) for _ in range(n))

    def join(a, b):
        return a + b if args.token_ids else f"{a} {b}"

    prefixes = [piece(args.prefix_len) for _ in range(args.num_prefixes)]
    ins = _lengths(args.input_len, args.range_ratio, args.num_prompts, rng)
    outs = _lengths(args.output_len, args.range_ratio, args.num_prompts, rng)
    work = []
    for i, (n_in, n_out) in enumerate(zip(ins, outs)):
        p = piece(n_in)
        if args.dataset == "prefix-repetition":
            p = join(prefixes[i % len(prefixes)], p)
            n_in += args.prefix_len
        work.append((p, n_in, n_out))
    return work


# --------------------------------------------------------------------------- one request
def _payload(args, prompt, max_tokens: int) -> tuple[str, dict]:
    common = {"model": args.model, "max_tokens": max_tokens, "stream": True,
              "temperature": args.temperature, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        common["ignore_eos"] = True
    if args.endpoint == "chat":
        text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        return "/chat/completions", dict(common, messages=[{"role": "user", "content": text}])
    return "/completions", dict(common, prompt=prompt)


def _content(chunk: dict) -> str | None:
    choices = chunk.get("choices") or []
    if not choices:
        return None
    c = choices[0]
    if "delta" in c:
        return (c["delta"] or {}).get("content") or ""
    return c.get("text") or ""


async def _sse_lines(r: httpx.Response):
    """The stream's lines split at "\n" only. (``aiter_lines`` splits like ``str.splitlines``,
    also at U+2028, U+0085 and friends, which JSON strings may carry unescaped: a random-token
    completion's text then breaks its ``data:`` line in two.)"""
    buf = ""
    async for text in r.aiter_text():
        buf += text
        *lines, buf = buf.split("\n")
        for line in lines:
            yield line.rstrip("\r")
    if buf:
        yield buf.rstrip("\r")


async def send_one(client: httpx.AsyncClient, args, prompt, n_in: int,
                   max_tokens: int) -> RequestResult:
    res = RequestResult(prompt_len=n_in)
    path, body = _payload(args, prompt, max_tokens)
    start = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with client.stream("POST", args.base_url.rstrip("/") + path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in _sse_lines(r):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])[:200]
                    return res
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"].get("completion_tokens", 0)
                    res.prompt_len = chunk["usage"].get("prompt_tokens", n_in)
                text = _content(chunk)
                if text:  # a chunk that carries output text
                    chunks += 1
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - start
        res.output_tokens = res.output_tokens or chunks
        res.ok = last is not None or res.output_tokens > 0
        if not res.ok:
            res.error = "no output"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


# --------------------------------------------------------------------------- driver
async def run_benchmark(args: argparse.Namespace) -> dict:
    """Run the workload and return the summary (also printed unless ``args.quiet``)."""
    work = make_prompts(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    rng = random.Random(args.seed + 1)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    async with httpx.AsyncClient(timeout=args.timeout, headers=headers, limits=limits) as c:
        for p, n_in, _ in work[: args.warmup]:
            await send_one(c, args, p, n_in, 4)

        async def limited(item):
            if sem is None:
                return await send_one(c, args, *item)
            async with sem:
                return await send_one(c, args, *item)

        tasks = []
        start = time.perf_counter()
        for item in work:
            tasks.append(asyncio.create_task(limited(item)))
            if math.isfinite(args.request_rate) and args.request_rate > 0:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    summary = summarize(results, duration, args.goodput, args.percentiles)
    if not args.quiet:
        print_summary(summary)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 0.5, "tpot": 0.05}`` (seconds)."""
    slos = {}
    for item in items or []:
        name, _, ms = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not ms:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS, e2el:MS; got {item!r}")
        slos[name] = float(ms) / 1000
    return slos


def summarize(results: list[RequestResult], duration: float, goodput: list[str] | None,
              percentiles: list[float]) -> dict:
    ok = [r for r in results if r.ok]
    slos = parse_goodput(goodput)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)

    def meets(r: RequestResult) -> bool:
        vals = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2e}
        return all(vals[k] <= v for k, v in slos.items())

    s: dict = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    if slos:
        s["goodput"] = sum(1 for r in ok if meets(r)) / duration
    series = {"ttft": [r.ttft for r in ok], "tpot": [t for r in ok if (t := r.tpot)],
              "itl": [x for r in ok for x in r.itl], "e2el": [r.e2e for r in ok]}
    for name, xs in series.items():
        s[f"mean_{name}_ms"] = 1000 * sum(xs) / len(xs) if xs else float("nan")
        for p in percentiles:
            s[f"p{p:g}_{name}_ms"] = 1000 * _pct(xs, p)
    return s


def print_summary(s: dict) -> None:
    print("=" * 20 + " Serving Benchmark Result " + "=" * 20)
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Benchmark duration (s)", s["duration_s"]),
            ("Total input tokens", s["total_input_tokens"]),
            ("Total generated tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", s["request_throughput"]),
            ("Output token throughput (tok/s)", s["output_throughput"]),
            ("Total token throughput (tok/s)", s["total_token_throughput"])]
    if "goodput" in s:
        rows.append(("Request goodput (req/s)", s["goodput"]))
    for k, v in rows:
        print(f"{k:<40}{v:>12.2f}" if isinstance(v, float) else f"{k:<40}{v:>12}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print(f"{'-' * 24}{title}{'-' * 24}")
        for k, v in s.items():
            if k.endswith(f"_{name}_ms"):
                label = k.replace(f"_{name}_ms", "").replace("mean", "Mean").replace("p", "P")
                print(f"{label + ' ' + name.upper() + ' (ms)':<40}{v:>12.2f}")
    for e in s["errors"]:
        print(f"error: {e}")
    print("=" * 66)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", required=True)
    p.add_argument("--api-key", default=None)
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    p.add_argument("--dataset", default="random", choices=["random", "prefix-repetition"])
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--tokenizer", default=None, help="decode random token ids with it")
    p.add_argument("--token-ids", action="store_true", help="send token id lists as prompts")
    p.add_argument("--vocab-size", type=int, default=512, help="for --token-ids w/o tokenizer")
    p.add_argument("--min-token-id", type=int, default=5)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrival rate (req/s); inf sends everything at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--goodput", nargs="+", default=None, metavar="SLO:MS",
                   help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:5000")
    p.add_argument("--percentiles", type=lambda s: [float(x) for x in s.split(",")],
                   default=[50.0, 99.0])
    p.add_argument("--warmup", type=int, default=1, help="short requests sent first")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", default=None)
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        parse_goodput(args.goodput)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = asyncio.run(run_benchmark(args))
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
