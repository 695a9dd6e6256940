"""Time (or profile) a batched workload step by step through ``LLM.step``.

    OMP_NUM_THREADS=1 python -m benchmarks.step_profile                # step times
    OMP_NUM_THREADS=1 python -m benchmarks.step_profile --cprofile     # + cProfile (C kernels)
    OMP_NUM_THREADS=1 python -m benchmarks.step_profile --torch        # + torch.profiler (CPU)
    python -m benchmarks.step_profile --model qwen3_5-h1024-l24-i5120 --requests 64 \
        --out 128 --phases                                             # + per-phase table

``--model``: ``smollm2`` (default, the trained SmolLM2-135M-Instruct), a shape of the
developers' sweep (``benchmarks.sweep``, e.g. ``dense-h1024-l24-gqa8-d128``) or a random model
named as ``benchmarks.llama_compare`` names them (``ARCH-hH-lL[-iI]``). ``--phases`` prints, per
step kind (prefill: some request computes several tokens; decode), each phase's time and share
(``benchmarks.step_phases``: timers wrapped around this one engine's calls, so the engine's
own path has no hook); ``PAGEFOLD_NATIVE_DECODE=0`` splits the native decode driver's time into
GDN recurrence and decode attention.

``--requests`` prompts of ``--prompt`` random tokens, ``--out`` greedy tokens each (default 32 x
256 -> 64, compare.py's ``smollm2-b32``), all submitted at once after one warm-up round; every
round draws fresh prompts so the prefix cache never hits. Prints per round the first step (the
first prefill chunk), the whole round and the median of the last decode steps. The compiled
kernels, called through ctypes, show in cProfile, not in torch.profiler; oneDNN's own kernels
show with ``ONEDNN_VERBOSE=profile_exec``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import time


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--out", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--cprofile", action="store_true")
    p.add_argument("--torch", action="store_true")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--phases", action="store_true", help="per-phase table of the last round")
    args = p.parse_args(argv)

    import torch

    from benchmarks.common import bench_model
    from benchmarks.llama_compare import hf_model
    from benchmarks.sweep import SHAPES
    from pagefold import LLM, SamplingParams

    shape = next((s for s in SHAPES if s.name == args.model), None)
    path = (bench_model(shape.arch, shape.hidden, shape.layers, **shape.overrides) if shape
            else hf_model(args.model))
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    llm = LLM(str(path), dtype="bfloat16", max_model_len=max(2048, args.prompt + args.out),
              kv_cache_memory=2 << 30, max_num_seqs=256,
              max_num_batched_tokens=args.max_num_batched_tokens)
    rng = random.Random(0)
    sp = SamplingParams(temperature=0, max_tokens=args.out, ignore_eos=True)

    def one_round() -> tuple[float, float, list[float]]:
        for _ in range(args.requests):
            ids = [rng.randrange(5, vocab) for _ in range(args.prompt)]
            llm.add_request({"prompt_token_ids": ids}, sp)
        t0 = time.perf_counter()
        steps, done = [], 0
        while done < args.requests:
            t = time.perf_counter()
            done += sum(o.finished for o in llm.step())
            steps.append(time.perf_counter() - t)
        return steps[0], time.perf_counter() - t0, steps

    one_round()  # warm-up: oneDNN primitives, kernel build
    timer = None
    print(f"threads {torch.get_num_threads()}")
    for i in range(args.rounds):
        prof = cProfile.Profile() if args.cprofile and i == 0 else None
        tprof = None
        if args.torch and i == 0:
            from torch.profiler import ProfilerActivity, profile

            tprof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
            tprof.__enter__()
        if args.phases and i == args.rounds - 1:
            from benchmarks.step_phases import instrument

            timer = instrument(llm)
        if prof:
            prof.enable()
        first, total, steps = one_round()
        if prof:
            prof.disable()
        if tprof:
            tprof.__exit__(None, None, None)
        dec = sorted(steps[-(args.out - 4):])
        print(f"round {i}: first step {first * 1e3:.0f} ms, total {total * 1e3:.0f} ms, "
              f"{len(steps)} steps, median decode step {dec[len(dec) // 2] * 1e3:.1f} ms")
        if prof:
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        if tprof:
            print(tprof.key_averages(group_by_input_shape=True).table(
                sort_by="self_cpu_time_total", row_limit=30))
    if timer is not None:
        print(f"phases of round {args.rounds - 1} ({args.model}, {args.requests} x "
              f"{args.prompt} -> {args.out}):")
        print(timer.table())


if __name__ == "__main__":
    main()
