"""bf16 products on this CPU: torch's bf16 GEMM vs pagefold's float32-slice path (csrc/gemm.py).

Part 1, the kernel: ``x (M, K) @ w (N, K).T`` for the linear shapes of a small and a larger
model at several M, bf16 (``F.linear``) against :func:`pagefold.csrc.gemm.linear` (forced on).
Part 2, end to end (``--model``, default the trained SmolLM2): the same prompts prefilled with
``PAGEFOLD_BF16_UPCAST=0`` and ``=1``, interleaved ``--repeat`` times; the greedy tokens must
agree (printed).

    python -m benchmarks.bf16_gemm                 # both parts
    python -m benchmarks.bf16_gemm --skip-model    # kernel table only
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch
import torch.nn.functional as F

SHAPES = [(1536, 576), (576, 1536), (49152, 576), (4096, 1024), (1024, 4096)]
ROWS = [4, 16, 64, 256, 2048]


def _time(fn, reps: int = 5) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def kernel_table() -> None:
    from pagefold.csrc import gemm

    os.environ["PAGEFOLD_BF16_UPCAST"] = "force"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; native bf16 GEMM: "
          f"{gemm.cpu_has_fast_bf16()}")
    print(f"{'N x K':>12} {'M':>5} {'bf16 ms':>9} {'fp32-slice ms':>14} {'speed-up':>9} "
          f"{'bf16 GFLOP/s':>13} {'slice GFLOP/s':>14}")
    for n, k in SHAPES:
        w = torch.randn(n, k).bfloat16()
        for m in ROWS:
            x = torch.randn(m, k).bfloat16()
            a = _time(lambda x=x, w=w: F.linear(x, w))
            b = _time(lambda x=x, w=w: gemm.linear(x, w) if x.shape[0] >= gemm.MIN_ROWS
                      else F.linear(x, w))
            flop = 2 * m * n * k
            print(f"{f'{n}x{k}':>12} {m:>5} {a * 1e3:>9.2f} {b * 1e3:>14.2f} {a / b:>9.2f} "
                  f"{flop / a / 1e9:>13.1f} {flop / b / 1e9:>14.1f}")


def end_to_end(model: str, prompts: int, length: int, repeat: int) -> None:
    from pagefold import LLM, SamplingParams

    llm = LLM(model, dtype="bfloat16", enable_prefix_caching=False)
    rng = random.Random(0)
    work = [{"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(length)]}
            for _ in range(prompts)]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    times: dict[str, list[float]] = {"0": [], "1": []}
    tokens: dict[str, list] = {}
    for _ in range(repeat):
        for flag in ("0", "1"):
            os.environ["PAGEFOLD_BF16_UPCAST"] = flag
            t0 = time.perf_counter()
            outs = llm.generate(work, sp, use_tqdm=False)
            times[flag].append(time.perf_counter() - t0)
            tokens[flag] = [o.outputs[0].token_ids for o in outs]
    best = {f: min(v) for f, v in times.items()}
    print(f"\n{prompts} x {length} tokens -> 8, bf16, best of {repeat}:")
    print(f"  torch bf16 GEMM  {best['0']:8.2f} s")
    print(f"  fp32 slices      {best['1']:8.2f} s   speed-up {best['0'] / best['1']:.2f}")
    same = sum(a == b for a, b in zip(tokens["0"], tokens["1"], strict=True))
    print(f"  greedy tokens identical for {same} of {prompts} prompts")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: SmolLM2)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--skip-model", action="store_true")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    kernel_table()
    if not args.skip_model:
        model = args.model
        if model is None:
            from pagefold.models.smollm2 import smollm2_checkpoint

            model = str(smollm2_checkpoint())
        end_to_end(model, args.prompts, args.length, args.repeat)


if __name__ == "__main__":
    main()
