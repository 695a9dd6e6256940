"""Batch-1 decode: this tree against another revision, side by side, and against the copy
bandwidth.

    python -m benchmarks.decode_b1 --base HEAD~3                 # SmolLM2 + GDN hybrid + dense
    python -m benchmarks.decode_b1 --base main --models smollm2 --rounds 5
    python -m benchmarks.decode_b1 --profile smollm2              # where one step's time goes
    python -m benchmarks.decode_b1 --models smollm2 --quantization fp8 int8 int4
    python -m benchmarks.decode_b1 --models smollm2 --quantization gguf   # the Q4_1 GGUF kept
    python -m benchmarks.decode_b1 --base main --batch 32 --requests 32 --out 32  # batched
    python -m benchmarks.decode_b1 --models smollm2 --guard-ab --busy 1  # a core taken
    python -m benchmarks.decode_b1 --models smollm2 --gemv amx avx512bf16 fma torch

Each (code, model) runs in its own subprocess, one after another, rounds interleaved (the
order flips every round) so that load from other processes on a shared machine falls on both
alike. ``--base REV``: that revision's ``pagefold/`` is exported (``git archive``) into a
temporary directory and put first on the worker's ``PYTHONPATH``; without it only this tree
runs. A worker loads the model (bf16), warms up, then decodes ``--requests`` requests one
after another (``--prompt`` tokens in, ``--out`` out, greedy, ignore EOS) and reports the
median time per output token over the decode steps (TPOT) and whether its tokens equal the
other code's.

Columns: ``tok/s`` = 1 / median TPOT (best round), ``ratio`` = this tree / base,
``MB/step`` = bytes a decode step must read (every weight but the input embedding table,
which is read one row at a time; a tied head is read as the head), ``GB/s`` = MB/step / TPOT,
``of copy`` = that over the copy bandwidth measured in the same worker (``torch.clone`` of a
512 MiB buffer, read + write counted, best of 5). ``CPU ms`` = median process CPU time per
decode step (best round) and ``CPU ratio`` its base / this: on a machine other processes
load, CPU time is the steadier measure of the work a step costs (run with ``--threads 1``).

``--busy N`` starts N busy-loop processes beside every worker (a host whose cores other work
takes); ``--guard-ab`` adds this tree with ``PAGEFOLD_THREAD_GUARD=0`` (``executor/
thread_guard.py`` off: steps keep every thread), its ratio against this tree. ``--gemv K ...``
adds this tree with ``PAGEFOLD_GEMV=K`` for each K (one GEMV kernel forced for every few-row
product, ``torch`` for none): ratios below 1 show the measured choice (``this``) beat it.

``--profile MODEL``: one worker of this tree under ``torch.profiler`` for 32 decode steps;
prints the ops by self CPU time and the Python-side share of a step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = ("smollm2", "qwen3_5-h1024-l12", "qwen3-h1024-l12")


def model_path(name: str, quantization: str | None = None) -> str:
    """The model's checkpoint; ``gguf`` on smollm2: the shipped Q4_1 GGUF (kept quantized)."""
    if name == "smollm2":
        from pagefold.models.smollm2 import smollm2_checkpoint, smollm2_gguf

        return str(smollm2_gguf() if quantization == "gguf" else smollm2_checkpoint())
    from benchmarks.common import bench_model

    arch, h, nl = name.rsplit("-", 2)
    return str(bench_model(arch, int(h[1:]), int(nl[1:])))


# ----------------------------------------------------------------------------- worker
def copy_bandwidth() -> float:
    """Bytes per second of a 512 MiB clone (read + write), best of 5."""
    import torch

    src = torch.ones(256 << 20, dtype=torch.int16)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst = src.clone()
        best = min(best, time.perf_counter() - t)
        del dst
    return 2 * src.numel() * src.element_size() / best


def step_bytes(llm) -> int:
    model = llm.engine.model
    emb = getattr(model.model.embed_tokens, "weight", None) if hasattr(model, "model") else None
    head = getattr(model, "lm_head", None)
    # GGUF layers (pf_weight_bytes), embeddings aside (a lookup reads its rows): a tied head
    # shares the table's weight, read whole, counted once
    gguf = {ident: nbytes for m in model.modules()
            if hasattr(m, "pf_weight_bytes") and not hasattr(m, "embedding_dim")
            for _, nbytes, ident in [m.pf_weight_bytes()]}
    total = 0
    seen = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p is emb and not (head is not None and getattr(head, "weight", None) is emb):
            continue  # an untied input table: one row per token
        total += p.numel() * p.element_size()
    try:  # quantized linears hold their weights outside parameters (kernel layout)
        from pagefold.quantization import QuantLinear
    except ImportError:  # a revision without quantization (--base)
        return total
    return total + sum(gguf.values()) + sum(m.nbytes for m in model.modules()
                       if isinstance(m, QuantLinear) and m.packed is not None)


def worker(spec: dict) -> dict:
    import torch

    from pagefold import LLM, SamplingParams

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    extra = {"quantization": spec["quantization"]} if spec.get("quantization") else {}
    llm = LLM(spec["model"], dtype="bfloat16", max_model_len=2048, kv_cache_memory=1 << 30,
              seed=0, **extra)
    sp = SamplingParams(temperature=0, max_tokens=spec["out"], ignore_eos=True)
    prompts = [[(17 * i + 31 * j) % 400 + 5 for j in range(spec["prompt"])]
               for i in range(spec["requests"])]
    llm.generate([{"prompt_token_ids": prompts[0]}],
                 SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    tpots, cpus, tokens = [], [], []
    prof = None
    if spec.get("profile"):  # process CPU time: what this process spends, whatever the load
        import cProfile

        prof = cProfile.Profile(time.process_time)
    batch = spec.get("batch", 1)
    for i in range(0, len(prompts), batch):
        for p in prompts[i:i + batch]:  # --batch requests decode side by side
            llm.add_request({"prompt_token_ids": p}, sp)
        last, out = None, []
        steps = 0
        while llm.engine.has_unfinished():
            if prof is not None and i == 0 and steps == 8:
                prof.enable()
            t, c = time.perf_counter(), time.process_time()
            res = llm.step()
            now, cpu = time.perf_counter(), time.process_time() - c
            if prof is not None and i == 0 and steps == 40:
                prof.disable()
            steps += 1
            for o in res:
                if o.outputs and len(o.outputs[0].token_ids) > 1 and last is not None:
                    tpots.append(now - t)
                    cpus.append(cpu)
                last = now
                if o.finished:
                    out.append(list(o.outputs[0].token_ids))
        tokens.append(sorted(out))
    result = {"tpot": statistics.median(tpots) / batch, "cpu": statistics.median(cpus),
              "tokens": tokens,
              "threads": torch.get_num_threads(), "bytes": step_bytes(llm),
              "copy_bw": copy_bandwidth()}
    if prof is not None:
        import pstats

        st = pstats.Stats(prof)
        print(f"32 decode steps; median step {result['tpot'] * 1e3:.2f} ms wall, "
              f"{result['cpu'] * 1e3:.2f} ms process CPU; by own CPU time (C kernels called "
              f"through ctypes count in their Python caller):", flush=True)
        st.sort_stats("tottime").print_stats(35)
    return result


# ----------------------------------------------------------------------------- driver
def run_worker(src: Path, spec: dict, tmp: Path, env_extra: dict | None = None,
               busy: int = 0) -> dict:
    """One worker process; ``busy`` busy-loop processes run beside it (a host whose cores
    other work takes)."""
    out = tmp / "result.json"
    out.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), str(REPO)]),
               HF_HUB_OFFLINE="1", **(env_extra or {}))
    code = ("import json,sys; from benchmarks.decode_b1 import worker; "
            f"json.dump(worker(json.loads(sys.argv[1])), open({str(out)!r}, 'w'))")
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        # cwd is the temporary folder: ``python -c`` puts its cwd first on the path, ahead of
        # PYTHONPATH, so a worker started in this checkout imported this pagefold/ as "base".
        subprocess.run([sys.executable, "-c", code, json.dumps(spec)], env=env, check=True,
                       cwd=str(tmp))
    finally:
        for lp in loops:
            lp.kill()
            lp.wait()
    return json.loads(out.read_text())


def export(rev: str, tmp: Path) -> Path:
    """``rev``'s ``pagefold/`` package in ``tmp/base`` (the benchmarks stay this tree's)."""
    dst = tmp / "base"
    dst.mkdir()
    arch = subprocess.run(["git", "-C", str(REPO), "archive", rev, "pagefold"],
                          check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dst)], input=arch, check=True)
    return dst


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default=None, help="git revision to compare with")
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--out", type=int, default=128)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads in the workers (default: torch's)")
    p.add_argument("--quantization", nargs="+", default=[], metavar="Q",
                   help="also run this tree with the weights quantized on load (fp8, int8, "
                   "int4): a row per format, its ratio against this tree in bf16")
    p.add_argument("--profile", default=None, metavar="MODEL")
    p.add_argument("--batch", type=int, default=1,
                   help="requests decoding together (--requests of them in all; tok/s and "
                        "TPOT count every request's tokens)")
    p.add_argument("--busy", type=int, default=0,
                   help="busy-loop processes beside every worker (a host whose cores other "
                        "processes take)")
    p.add_argument("--guard-ab", action="store_true",
                   help="also run this tree with PAGEFOLD_THREAD_GUARD=0 (steps keep every "
                        "thread whatever the host does): a row with its ratio against this")
    p.add_argument("--gemv", nargs="+", default=[], metavar="K",
                   help="also run this tree with PAGEFOLD_GEMV=K (amx, avx512bf16, fma, "
                        "torch, flags): a row per kernel, its ratio against this")
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from benchmarks.common import print_table

    tmp = Path(tempfile.mkdtemp(prefix="pagefold-decode-b1-"))
    spec = {"requests": args.requests, "prompt": args.prompt, "out": args.out,
            "threads": args.threads, "batch": args.batch}
    if args.profile:
        run_worker(REPO, dict(spec, model=model_path(args.profile), profile=True,
                              requests=1, out=max(args.out, 48)), tmp)
        return
    codes = {"this": REPO}
    if args.base:
        codes["base"] = export(args.base, tmp)
    quant = {f"this+{q}": q for q in args.quantization}
    codes.update({c: REPO for c in quant})
    envs = {"this+noguard": {"PAGEFOLD_THREAD_GUARD": "0"}} if args.guard_ab else {}
    envs.update({f"this+gemv={k}": {"PAGEFOLD_GEMV": k} for k in args.gemv})
    codes.update({c: REPO for c in envs})
    got: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        for m in args.models:
            order = list(codes) if r % 2 == 0 else list(reversed(codes))
            for c in order:
                res = run_worker(codes[c], dict(spec, model=model_path(m, quant.get(c)),
                                                quantization=quant.get(c)), tmp,
                                 envs.get(c), args.busy)
                got.setdefault((m, c), []).append(res)
                print(f"round {r} {m} {c}: {1 / res['tpot']:.1f} tok/s", flush=True)
    rows = []
    for m in args.models:
        best = {c: min(got[(m, c)], key=lambda x: x["tpot"]) for c in codes}
        for c in codes:
            b = best[c]
            gbs = b["bytes"] / b["tpot"] / 1e9
            row = {"model": m, "code": c, "threads": b["threads"], "tok/s": 1 / b["tpot"],
                   "TPOT ms": b["tpot"] * 1e3,
                   "all rounds tok/s": " ".join(f"{1 / x['tpot']:.1f}" for x in got[(m, c)]),
                   "MB/step": b["bytes"] / 1e6, "GB/s": gbs,
                   "of copy": gbs * 1e9 / b["copy_bw"]}
            row["CPU ms"] = min(x["cpu"] for x in got[(m, c)]) * 1e3
            if c in quant or c in envs:
                row["ratio"] = best["this"]["tpot"] / b["tpot"]
                row["CPU ratio"] = (min(x["cpu"] for x in got[(m, "this")])
                                    / min(x["cpu"] for x in got[(m, c)]))
            if c == "this" and "base" in best:
                row["ratio"] = best["base"]["tpot"] / b["tpot"]
                row["CPU ratio"] = (min(x["cpu"] for x in got[(m, "base")])
                                    / min(x["cpu"] for x in got[(m, c)]))
                row["same tokens"] = b["tokens"] == best["base"]["tokens"]
            rows.append(row)
    print_table(rows, ["model", "code", "threads", "tok/s", "ratio", "TPOT ms", "CPU ms",
                       "CPU ratio",
                       "all rounds tok/s", "MB/step", "GB/s", "of copy", "same tokens"])


if __name__ == "__main__":
    main()
