"""The GPU half of the device check: bf16 exactness and pagefold vs transformers on CUDA,
against the device's own copy bandwidth and bf16 matmul rate (measured in the same run).

    python -m benchmarks.device_check --out /tmp/out            # everything (one H200 call)
    python -m benchmarks.device_check --quick                   # tiny shapes, a smoke run

Run by ``benchmarks/device_check.sh`` after the exactness tests. For each architecture
(``qwen3`` dense, ``qwen3_5`` Gated DeltaNet hybrid) and shape (``150m``: hidden 1024 x 12
layers; ``1b``: hidden 2048 x 20 layers; random bf16 weights, a 512-token vocabulary):

* batch-1 decode: pagefold's TPOT over 64 tokens after a 256-token prompt; the bytes a step must
  read (:func:`benchmarks.compare.decode_step_bytes`: weights but the embedding table, K/V or
  states) divided by TPOT, as a fraction of the measured device copy bandwidth
  ((read + write bytes) / time of a 2 GiB device-to-device copy);
* batch 64: 64 prompts x 256 tokens -> 128, output tokens/s of pagefold (driven by ``step``)
  and of transformers' batched ``generate()`` on the same GPU, and their ratio;
* prefill: 64 x 256 prompt tokens, ``2 * params * tokens / time`` against the measured bf16
  matmul rate (8192^3 products).

bf16 exactness: pagefold's greedy tokens vs transformers' (both bf16, both on the GPU) for 16
prompts of the tiny test models; reported as the share of identical continuations (bf16
rounding differs between implementations, so this is a measurement, not a pass/fail).

Writes ``device_check.json`` and ``device_check.md`` (a table for BENCHMARKS.md) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SHAPES = {"150m": (1024, 12), "1b": (2048, 20)}
QUICK_SHAPES = {"tiny": (256, 4)}


def _sync():
    import torch

    torch.cuda.synchronize()


def copy_bandwidth(gib: float = 2.0) -> float:
    """Device-to-device copy, (read + write bytes) / time, best of 10, in GB/s."""
    import torch

    a = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    _sync()
    best = float("inf")
    for _ in range(10):
        t = time.perf_counter()
        b.copy_(a)
        _sync()
        best = min(best, time.perf_counter() - t)
    return 2 * a.numel() * 4 / best / 1e9


def matmul_tflops(n: int = 8192) -> float:
    import torch

    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    _sync()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    _sync()
    return 2 * n**3 * 10 / (time.perf_counter() - t) / 1e12


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(length)] for _ in range(n)]


def bench_pagefold(model_dir: str, n_params: int) -> dict:
    from benchmarks.compare import _drive
    from pagefold import LLM, SamplingParams

    llm = LLM(model_dir, dtype="bfloat16", max_model_len=1024, kv_cache_memory=8 << 30,
              max_num_seqs=256)
    warm = [{"prompt_token_ids": p} for p in _prompts(64, 16, 500, 0)]
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)  # compiles the kernels, captures the decode graphs
    ids: dict[str, str] = {}

    def add(rid: str, w: dict) -> None:
        sp = SamplingParams(temperature=0, max_tokens=w["out"], ignore_eos=True)
        ids[llm.add_request({"prompt_token_ids": w["ids"]}, sp)] = rid

    def step():
        return [(ids[o.request_id], len(o.outputs[0].token_ids), o.finished)
                for o in llm.step()]

    one = [{"ids": p, "out": 64} for p in _prompts(2, 256, 500, 1)]
    batch = [{"ids": p, "out": 128} for p in _prompts(64, 256, 500, 2)]
    lat = _drive(add, step, one, True)
    thr = _drive(add, step, batch, False)
    _sync()
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": w["ids"]} for w in batch],
                 SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    _sync()
    prefill_s = time.perf_counter() - t
    return {"tpot_b1": lat["tpot"], "ttft_b1": lat["ttft"],
            "tok_s_b64": thr["n_out"] / thr["seconds"],
            "prefill_tflops": 2 * n_params * 64 * 256 / prefill_s / 1e12}


def bench_transformers(model_dir: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    prompts = _prompts(64, 256, 500, 2)
    ids = torch.tensor(prompts, device="cuda")
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=m.config.vocab_size + 1)
    with torch.inference_mode():
        m.generate(input_ids=ids[:2, :16], max_new_tokens=4, min_new_tokens=4, **kw)
        _sync()
        t = time.perf_counter()
        m.generate(input_ids=ids, max_new_tokens=128, min_new_tokens=128, **kw)
        _sync()
        s = time.perf_counter() - t
    del m
    torch.cuda.empty_cache()
    return {"tok_s_b64": 64 * 128 / s}


def _hf_greedy_cuda(model_dir: str, prompts: list[list[int]], new: int) -> list[list[int]]:
    """transformers' greedy continuations in bf16 on the GPU, one prompt at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    vocab = m.config.get_text_config().vocab_size
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            g = m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                           eos_token_id=vocab + 1)
            out.append(g[0, len(p):].tolist())
    del m
    torch.cuda.empty_cache()
    return out


def bf16_exactness(arch: str) -> dict:
    """pagefold (bf16, CUDA, chunked prefill) vs transformers (bf16, CUDA) greedy tokens on
    a tiny bf16 test model: identical continuations and first divergences."""
    import torch

    from pagefold import LLM, SamplingParams
    from pagefold.testing.tiny_models import build_tiny_model, random_prompts

    d = str(build_tiny_model(arch, Path("/tmp/pf_device_models") / arch, dtype=torch.bfloat16))
    prompts = random_prompts(16, 5, 60, 512, seed=3)
    llm = LLM(d, dtype="bfloat16", max_model_len=128, max_num_batched_tokens=33)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    del llm
    torch.cuda.empty_cache()
    ref = _hf_greedy_cuda(d, prompts, 16)
    first_div = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                 for a, b in zip(got, ref)]
    return {"identical": sum(a == b for a, b in zip(got, ref)), "of": len(prompts),
            "first_divergence": first_div}


def _param_count(model_dir: str) -> int:
    from safetensors import safe_open

    n = 0
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for k in f.keys():
                c = 1
                for s in f.get_slice(k).get_shape():
                    c *= s
                n += c
    return n


def main(argv: list[str] | None = None) -> None:
    import torch

    from benchmarks.common import bench_model
    from benchmarks.compare import decode_step_bytes

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".")
    p.add_argument("--archs", nargs="+", default=["qwen3", "qwen3_5"])
    p.add_argument("--quick", action="store_true", help="tiny shapes only (smoke run)")
    p.add_argument("--skip-hf", action="store_true", help="no transformers baseline")
    a = p.parse_args(argv)
    assert torch.cuda.is_available(), "the device check needs CUDA"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    res["copy_gbps"] = copy_bandwidth()
    res["matmul_tflops"] = matmul_tflops()
    print(f"copy {res['copy_gbps']:.0f} GB/s, bf16 matmul {res['matmul_tflops']:.0f} TFLOP/s",
          flush=True)
    res["bf16_exactness"] = {}
    for arch in a.archs:
        try:
            res["bf16_exactness"][arch] = bf16_exactness(arch)
        except Exception as e:  # noqa: BLE001 - report, keep measuring
            res["bf16_exactness"][arch] = {"error": repr(e)}
        print(arch, "bf16", res["bf16_exactness"][arch], flush=True)
    rows = []
    for arch in a.archs:
        for shape, (hidden, layers) in (QUICK_SHAPES if a.quick else SHAPES).items():
            d = str(bench_model(arch, hidden, layers))
            n_params = _param_count(d)
            row = {"arch": arch, "shape": shape, "params": n_params}
            row.update(bench_pagefold(d, n_params))
            try:
                step_bytes = decode_step_bytes(d, 256 + 32)
            except FileNotFoundError:  # a sharded checkpoint: weights only (a lower bound)
                step_bytes = 2 * n_params
            row["decode_gbps"] = step_bytes / row["tpot_b1"] / 1e9
            row["bw_frac"] = row["decode_gbps"] / res["copy_gbps"]
            row["prefill_frac"] = row["prefill_tflops"] / res["matmul_tflops"]
            if not a.skip_hf:
                row["hf_tok_s_b64"] = bench_transformers(d)["tok_s_b64"]
                row["x_hf_b64"] = row["tok_s_b64"] / row["hf_tok_s_b64"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    res["rows"] = rows
    (out / "device_check.json").write_text(json.dumps(res, indent=1))
    lines = [f"GPU check, {res['date']}, {res['device']} (torch {res['torch']}): copy "
             f"{res['copy_gbps']:.0f} GB/s, bf16 matmul {res['matmul_tflops']:.0f} TFLOP/s", "",
             "| arch | shape | params | b1 TPOT ms | b1 GB/s | % copy BW | b64 tok/s | "
             "HF b64 tok/s | x HF | prefill TFLOP/s | % matmul |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['arch']} | {r['shape']} | {r['params'] / 1e6:.0f}M | "
            f"{r['tpot_b1'] * 1e3:.3f} | {r['decode_gbps']:.0f} | {100 * r['bw_frac']:.0f}% | "
            f"{r['tok_s_b64']:.0f} | {r.get('hf_tok_s_b64', float('nan')):.0f} | "
            f"{r.get('x_hf_b64', float('nan')):.1f} | {r['prefill_tflops']:.0f} | "
            f"{100 * r['prefill_frac']:.0f}% |")
    (out / "device_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
