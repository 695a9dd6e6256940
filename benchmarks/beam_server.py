"""Beam search through ``pagefold serve`` (one engine request per beam per step, driven from
the API process) vs the offline forking driver ``LLM.beam_search``, same model and prompts.

    python -m benchmarks.beam_server [--prompts 4] [--input-len 64] [--width 4] [--steps 32]

The server runs first (its own process; the client only waits), then the offline engine in
this process, on the same tiny model (``bench_model``: qwen3, hidden 256, 4 layers); each is
timed over ``--rounds`` runs after one warm-up run. Printed: seconds per run of each, the ratio
server / offline, and whether the beams' token ids are identical (they must be).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import httpx

from benchmarks.common import bench_model, random_workload
from benchmarks.serve_compare import _free_port, stop, wait_ready


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = str(bench_model("qwen3"))
    prompts = [p for p, _ in random_workload(args.prompts, (args.input_len, args.input_len),
                                             (1, 1), 512, seed=0)]
    body = {"model": "bench", "prompt": prompts, "n": args.width, "max_tokens": args.steps,
            "use_beam_search": True, "ignore_eos": True, "return_token_ids": True}
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagefold.entrypoints.cli", "serve", model,
                             "--port", str(port), "--served-model-name", "bench",
                             "--max-model-len", "1024", "--kv-cache-memory", "64MiB",
                             "--uvicorn-log-level", "warning"])
    try:
        wait_ready(port, proc)
        times = []
        for r in range(args.rounds + 1):
            t0 = time.perf_counter()
            resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                              timeout=600)
            resp.raise_for_status()
            if r:
                times.append(time.perf_counter() - t0)
        served = [c["token_ids"] for c in resp.json()["choices"]]
    finally:
        stop(proc)
    server_s = min(times)

    from pagefold import LLM, BeamSearchParams

    llm = LLM(model, max_model_len=1024, kv_cache_memory="64MiB")
    params = BeamSearchParams(beam_width=args.width, max_tokens=args.steps, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    times = []
    for r in range(args.rounds + 1):
        t0 = time.perf_counter()
        outs = llm.beam_search(inputs, params)
        if r:
            times.append(time.perf_counter() - t0)
    offline_s = min(times)
    offline = [s.tokens[len(p):] for p, o in zip(prompts, outs) for s in o.sequences]
    print(f"{args.prompts} prompts x {args.input_len} tokens, width {args.width}, "
          f"{args.steps} steps (best of {args.rounds})")
    print(f"server  {server_s:8.3f} s/run")
    print(f"offline {offline_s:8.3f} s/run")
    print(f"server / offline {server_s / offline_s:.2f}; same beams: {served == offline}")


if __name__ == "__main__":
    main()
