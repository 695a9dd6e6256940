"""Multi-LoRA throughput: one batch whose rows use 4 different adapters vs the base model alone.

    python -m benchmarks.lora_batch [--arch qwen3 --hidden 1024 --layers 12 --rank 16]

Same model (~150M parameters by default, bf16), same prompts, greedy. Rows: ``base`` (an
engine with LoRA off), then on one engine with ``enable_lora``: ``base, lora on`` (no request
names an adapter: the cost of having it enabled) and ``4 adapters`` (the prompts split evenly
over 4 random rank ``--rank`` adapters on q/k/v/o/gate/up/down, all resident:
``max_loras=4``). Both engines live in this process and the three batches alternate
``--reps`` times, each keeping its best time, so they see the same (shared, noisy) machine.
The adapters are PEFT directories written here (random A and B, ``adapter_config.json`` +
``adapter_model.safetensors``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.common import bench_model, print_table, random_workload

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(model_dir: Path, out: Path, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter for the dense model in ``model_dir``."""
    cfg = json.loads((model_dir / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for name in TARGETS:
            fin, fout = shapes[name]
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fin, generator=g)
                                               / fin ** 0.5).to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = (0.01 * torch.randn(fout, rank, generator=g)
                                               ).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "bias": "none", "base_model_name_or_path": str(model_dir)}))
    return out


def _engine(model: str, args, lora: bool):
    from pagefold import LLM

    kw = dict(enable_lora=True, max_loras=4, max_lora_rank=args.rank) if lora else {}
    return LLM(model, dtype="bfloat16", max_num_batched_tokens=args.max_num_batched_tokens,
               kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=False, **kw)


def run(model: str, work, args, adapters: list[Path]) -> list[dict]:
    """Both engines in this process; the three batches alternate ``--reps`` times (so they
    see the same machine) and each keeps its best time."""
    from pagefold import LoRARequest, SamplingParams

    off, on = _engine(model, args, False), _engine(model, args, True)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in work]
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    reqs = [LoRARequest(f"a{i}", i + 1, str(a)) for i, a in enumerate(adapters)]
    mixed = [reqs[i % len(reqs)] for i in range(len(work))]
    batches = {"base": (off, None), "base, lora on": (on, None),
               f"{len(reqs)} adapters": (on, mixed)}
    for llm, loras in batches.values():  # warm-up (and the adapters made resident)
        n = len(reqs) if loras else 1
        llm.generate(prompts[:n], params[:n], use_tqdm=False,
                     lora_request=loras[:n] if loras else None)
    best = {name: float("inf") for name in batches}
    for _ in range(args.reps):
        for name, (llm, loras) in batches.items():
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
            best[name] = min(best[name], time.perf_counter() - t)
    n_out = sum(o for _, o in work)
    n_in = sum(len(p) for p, _ in work)
    return [{"engine": name, "seconds": dt, "out tok/s": n_out / dt,
             "total tok/s": (n_in + n_out) / dt} for name, dt in best.items()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="qwen3", help="a dense architecture (llama, qwen2, qwen3)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    model = bench_model(args.arch, args.hidden, args.layers)
    adapters = [write_adapter(model, model / "lora" / f"r{args.rank}-{i}", args.rank, i)
                for i in range(4)]
    work = random_workload(args.num_prompts, (args.input_len, args.input_len),
                           (args.output_len, args.output_len), 500)
    rows = run(str(model), work, args, adapters)
    for r in rows:
        r["x base"] = r["out tok/s"] / rows[0]["out tok/s"]
    print(f"{args.arch} h{args.hidden} l{args.layers}, bf16, {args.num_prompts} prompts "
          f"{args.input_len} -> {args.output_len}, rank {args.rank}, "
          f"{torch.get_num_threads()} threads")
    print_table(rows, ["engine", "seconds", "out tok/s", "total tok/s", "x base"])


if __name__ == "__main__":
    main()
