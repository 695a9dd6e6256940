"""Offline throughput: pagefold vs transformers' batched generate(), same workload, one run.

    python -m benchmarks.throughput [--num-prompts 64 --input-len 256 --output-len 128]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import bench_model, print_table, random_workload


def run_pagefold(model: str, work, dtype: str, args) -> dict:
    from pagefold import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=args.max_num_seqs, kv_cache_memory=args.kv_cache_memory)
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in work]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.quiet)
    dt = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return _row("pagefold", dt, work, n_out)


def run_transformers(model: str, work, dtype: str, args) -> dict:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    bs = args.hf_batch_size or len(work)
    n_out = 0

    def batch_generate(items):
        nonlocal n_out
        width = max(len(p) for p, _ in items)
        ids = torch.zeros((len(items), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(items):  # left padding, as decoder-only generation needs
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        new = max(o for _, o in items)
        with torch.inference_mode():
            out = m.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                             eos_token_id=m.config.vocab_size + 1)
        n_out += sum(o for _, o in items)  # count what each request asked for
        return out

    batch_generate(work[:2])  # warm-up
    n_out = 0
    t = time.perf_counter()
    for i in range(0, len(work), bs):
        batch_generate(work[i : i + bs])
    dt = time.perf_counter() - t
    return _row("transformers", dt, work, n_out)


def _row(name: str, dt: float, work, n_out: int) -> dict:
    n_in = sum(len(p) for p, _ in work)
    return {"system": name, "seconds": dt, "req/s": len(work) / dt, "input tok/s": n_in / dt,
            "output tok/s": n_out / dt}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--arch", default="qwen3")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--model", default=None, help="model dir (default: build a tiny one)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs="+", default=[256], help="L or MIN MAX")
    p.add_argument("--output-len", type=int, nargs="+", default=[128], help="L or MIN MAX")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--hf-batch-size", type=int, default=None)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    model = args.model or str(bench_model(args.arch, args.hidden, args.layers))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    rng = lambda v: (v[0], v[-1])  # noqa: E731
    work = random_workload(args.num_prompts, rng(args.input_len), rng(args.output_len), vocab,
                           args.seed)
    rows = [run_pagefold(model, work, args.dtype, args)]
    if not args.skip_transformers:
        rows.append(run_transformers(model, work, args.dtype, args))
        base = rows[1]["output tok/s"]
        for r in rows:
            r["vs transformers"] = r["output tok/s"] / base
    print(f"\nmodel {model} ({args.dtype}), {args.num_prompts} prompts, input {args.input_len}, "
          f"output {args.output_len}, torch threads {torch.get_num_threads()}")
    print_table(rows, ["system", "seconds", "req/s", "input tok/s", "output tok/s",
                       "vs transformers"])


if __name__ == "__main__":
    main()
