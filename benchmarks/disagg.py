"""Prefill/decode disaggregation vs one engine, under a mixed long-prompt / chat load (issue 38).

    python -m benchmarks.disagg [--arch qwen3_5] [--hidden 512] [--layers 8] [--long 1500]
                                [--n-long 4] [--n-chat 12] [--rate 2]

Two setups serve the same workload, one after the other: ``one engine`` (a ``pagefold serve``)
and ``P/D`` (a kv_producer and a kv_consumer ``pagefold serve`` behind ``pagefold proxy``).
The workload (random token ids, a fixed seed) mixes ``--n-long`` long prompts (``--long``
tokens, 16 output tokens) with ``--n-chat`` short chat turns (64 tokens, 32 output tokens),
arriving ``--rate`` per second in a shuffled order, all streamed (ignore_eos: every request
emits exactly its output tokens). Per request: TTFT (send to first streamed token) and TPOT
(first to last token over the tokens after the first). Reported: TTFT and TPOT p50 / p99
over all requests and per kind, and output tokens per second over the run. The point of P/D
is that long prefills stop stalling the decodes of chat turns (TPOT p99), at the cost of a
transfer per request. By default the producer and the consumer each get half of this
process's cores (affinity and ``OMP_NUM_THREADS``: two engines' OpenMP threads spinning on
the same cores slow both down), while the one engine gets them all: the same hardware; the
one engine also runs on the producer's share alone, to tell the threading apart from the
split of roles.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.common import bench_model, print_table

MAX_MODEL_LEN = 2048


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model: str, port: int, log, transfer: dict | None,
           cpus: list[int] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagefold.entrypoints.cli", "serve", model, "--port", str(port),
           "--dtype", "bfloat16", "--kv-cache-memory", "1GiB", "--max-model-len",
           str(MAX_MODEL_LEN), "--served-model-name", "bench", "--uvicorn-log-level", "warning"]
    if transfer is not None:
        cmd += ["--kv-transfer-config", json.dumps(transfer)]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if cpus is not None:  # its own cores: OpenMP threads of two engines never share one
        env["OMP_NUM_THREADS"] = str(len(cpus))
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)


def _wait(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(url)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()


def workload(args, vocab: int) -> list[dict]:
    rng = random.Random(0)
    reqs = [{"kind": "long", "prompt": [rng.randrange(vocab) for _ in range(args.long)],
             "max_tokens": 16} for _ in range(args.n_long)]
    reqs += [{"kind": "chat", "prompt": [rng.randrange(vocab) for _ in range(64)],
              "max_tokens": 32} for _ in range(args.n_chat)]
    rng.shuffle(reqs)
    return reqs


async def _one(client: httpx.AsyncClient, url: str, req: dict, delay: float) -> dict:
    await asyncio.sleep(delay)
    body = {"model": "bench", "prompt": req["prompt"], "max_tokens": req["max_tokens"],
            "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    first = last = None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                now = time.perf_counter()
                first = first or now
                last = now
    return {"kind": req["kind"], "ttft": first - t0,
            "tpot": (last - first) / max(1, req["max_tokens"] - 1),
            "end": last, "start": t0, "tokens": req["max_tokens"]}


async def run_load(url: str, reqs: list[dict], rate: float) -> list[dict]:
    async with httpx.AsyncClient(timeout=None) as client:
        # One warm-up request (first-batch costs), then the load.
        await _one(client, url, {"kind": "warm", "prompt": [1] * 32, "max_tokens": 2}, 0)
        return await asyncio.gather(*[_one(client, url, r, i / rate)
                                      for i, r in enumerate(reqs)])


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summarize(name: str, res: list[dict]) -> list[dict]:
    rows = []
    wall = max(r["end"] for r in res) - min(r["start"] for r in res)
    for kind in ("all", "long", "chat"):
        sel = [r for r in res if kind == "all" or r["kind"] == kind]
        ttft = [r["ttft"] * 1000 for r in sel]
        tpot = [r["tpot"] * 1000 for r in sel]
        rows.append({"setup": name, "requests": f"{kind} ({len(sel)})",
                     "TTFT p50 ms": statistics.median(ttft), "TTFT p99 ms": _pct(ttft, 0.99),
                     "TPOT p50 ms": statistics.median(tpot), "TPOT p99 ms": _pct(tpot, 0.99),
                     "out tok/s": sum(r["tokens"] for r in sel) / wall if kind == "all"
                     else ""})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen3_5")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--long", type=int, default=1500)
    ap.add_argument("--n-long", type=int, default=4)
    ap.add_argument("--n-chat", type=int, default=12)
    ap.add_argument("--rate", type=float, default=2.0, help="arrivals per second")
    ap.add_argument("--no-split-cores", dest="split_cores", action="store_false",
                    help="let both P/D instances use every core (by default the producer "
                         "gets the first half of this process's cores, the consumer the rest)")
    args = ap.parse_args()
    model = str(bench_model(args.arch, args.hidden, args.layers))
    vocab = json.loads((Path(model) / "config.json").read_text()).get("vocab_size", 512)
    reqs = workload(args, vocab)
    logs = Path(tempfile.mkdtemp(prefix="pagefold-disagg-bench-"))
    rows = []
    cpus = sorted(os.sched_getaffinity(0))
    half = [cpus[:len(cpus) // 2], cpus[len(cpus) // 2:]] if args.split_cores \
        and len(cpus) > 1 else [None, None]
    singles = [("one engine", None)]
    if half[0] is not None:  # the same engine on one instance's share: threads vs roles
        singles.append((f"one engine, cores {half[0]}", half[0]))
    for name, cores in singles:
        with open(logs / "one.log", "a") as log:
            port = _port()
            proc = _serve(model, port, log, None, cores)
            try:
                _wait(f"http://127.0.0.1:{port}", proc)
                rows += summarize(name, asyncio.run(
                    run_load(f"http://127.0.0.1:{port}", reqs, args.rate)))
            finally:
                _stop([proc])
    with open(logs / "pd.log", "w") as log:
        pp, dp, xp, kv = _port(), _port(), _port(), _port()
        procs = [_serve(model, pp, log, {"kv_role": "kv_producer", "kv_port": kv}, half[0]),
                 _serve(model, dp, log, {"kv_role": "kv_consumer"}, half[1])]
        try:
            for port, proc in zip((pp, dp), procs):
                _wait(f"http://127.0.0.1:{port}", proc)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "pagefold.entrypoints.cli", "proxy", "--prefill",
                 f"http://127.0.0.1:{pp}", "--decode", f"http://127.0.0.1:{dp}", "--port",
                 str(xp)], stdout=log, stderr=subprocess.STDOUT))
            _wait(f"http://127.0.0.1:{xp}", procs[-1])
            rows += summarize("P/D (proxy)", asyncio.run(
                run_load(f"http://127.0.0.1:{xp}", reqs, args.rate)))
            pool = httpx.get(f"http://127.0.0.1:{dp}/v1/admin/pool").json()
            print(f"decode instance: {pool['transfer_tokens_loaded']} prompt tokens pulled, "
                  f"{pool['transfer_bytes_loaded'] / 2**20:.1f} MiB, "
                  f"{pool['transfer_load_failures']} failed pages")
        finally:
            _stop(procs)
    print(f"{args.arch} hidden {args.hidden} layers {args.layers}: {args.n_long} x "
          f"{args.long}-token prompts + {args.n_chat} x 64-token chats, {args.rate}/s; P/D "
          f"cores {half}; logs in {logs}")
    print_table(rows, ["setup", "requests", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                       "TPOT p99 ms", "out tok/s"])


if __name__ == "__main__":
    main()
