"""Tensor and pipeline parallelism on this CPU: TP=2 and PP=2 (two ranks, one thread each) vs
TP=1 (one thread).

    python -m benchmarks.tp_compare [--arch qwen3 --hidden 1024 --layers 12] [--no-pp]

Same model (~150M parameters by default), same token ids, greedy, bf16. Workloads: ``batch``
(16 prompts of 256 tokens -> 64 each, all at once) and ``latency`` (one request of 256 -> 64 at
a time, 3 requests). Each rank gets one torch thread, the TP=1 engine one thread, so the ratio
shows what splitting the work over two cores buys after the collectives' cost (gloo over
loopback: one all-reduce per row-parallel layer, one gather of the logits). PP=2 splits the
layers into two stages, hidden states sent between them; it runs twice: with one step message
at a time (``PAGEFOLD_PP_BATCHES_IN_FLIGHT=1``: the stages take turns, ``in flight`` 1) and
with two in flight (the default: stage 0 runs one message while stage 1 runs the previous).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.common import bench_model, print_table, random_workload


def run(model: str, tp: int, work, args, pp: int = 1, in_flight: int | None = None) -> dict:
    from pagefold import LLM, SamplingParams
    from pagefold.engine.batch_queue import ENV_IN_FLIGHT

    os.environ.pop(ENV_IN_FLIGHT, None)
    if in_flight is not None:
        os.environ[ENV_IN_FLIGHT] = str(in_flight)
    llm = LLM(model, dtype="bfloat16", tensor_parallel_size=tp, pipeline_parallel_size=pp,
              threads_per_rank=1,
              max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory=args.kv_cache_memory)
    try:
        params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in work]
        prompts = [{"prompt_token_ids": p} for p, _ in work]
        llm.generate(prompts[:1], params[:1], use_tqdm=False)  # warm-up
        rows = []
        for name, batches in (("batch", [list(range(len(work)))]),
                              ("latency", [[i] for i in range(3)])):
            t = time.perf_counter()
            n_out = 0
            for idx in batches:
                outs = llm.generate([prompts[i] for i in idx], [params[i] for i in idx],
                                    use_tqdm=False)
                n_out += sum(len(o.outputs[0].token_ids) for o in outs)
            dt = time.perf_counter() - t
            rows.append({"workload": name, "tp": tp, "pp": pp,
                         "in flight": in_flight or pp, "seconds": dt,
                         "out tok/s": n_out / dt})
        return rows
    finally:
        llm.engine.shutdown()
        os.environ.pop(ENV_IN_FLIGHT, None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="qwen3")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--no-pp", action="store_true", help="skip the PP=2 run")
    args = p.parse_args()
    torch.set_num_threads(1)
    model = str(bench_model(args.arch, args.hidden, args.layers))
    work = random_workload(args.num_prompts, (args.input_len, args.input_len),
                           (args.output_len, args.output_len), 500)
    one = run(model, 1, work, args)
    others = [run(model, 2, work, args)]
    if not args.no_pp:
        others.append(run(model, 1, work, args, pp=2, in_flight=1))
        others.append(run(model, 1, work, args, pp=2))
    rows = []
    for i, a in enumerate(one):
        rows += [a] + [dict(o[i], **{"x TP=1": o[i]["out tok/s"] / a["out tok/s"]})
                       for o in others]
    print(f"{args.arch} h{args.hidden} l{args.layers}, bf16, one thread per rank")
    print_table(rows, ["workload", "tp", "pp", "in flight", "seconds", "out tok/s", "x TP=1"])


if __name__ == "__main__":
    main()
