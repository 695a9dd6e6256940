"""Draft-model and MTP speculation on tiny random models: the machinery's cost, side by side.

    python -m benchmarks.spec_draft [--max-tokens 64] [--repeats 3] [--k 3]

A tiny Qwen3 target (hidden 64) with drafts of the *same size* (an exact copy: every draft
accepted; a noisy copy: partial acceptance), n-gram for reference, and a tiny Qwen3.5 with
random MTP weights (drafts rejected: the worst case). Batch 1, greedy, best of ``--repeats``.
On models this small every forward costs about the same, so a round of ``k`` drafts costs
``k + 1`` draft passes and one verify: the table shows that overhead, not the speed-up a
draft 10-50x smaller than its target gives. Columns: output tokens/s, ratio to OFF, acceptance.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    from pagefold import LLM, SamplingParams
    from pagefold.testing import tiny_models
    from pagefold.testing.spec_models import add_mtp_weights, perturbed_copy

    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=3)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="spec_draft_"))
    try:
        target = tiny_models.build_tiny_model("qwen3", root / "qwen3")
        hybrid = tiny_models.build_tiny_model("qwen3_5", root / "qwen3_5")
        add_mtp_weights(hybrid)
        k = args.k
        cases = {
            "qwen3 off": (target, None),
            "qwen3 ngram": (target, {"method": "ngram", "num_speculative_tokens": k}),
            "qwen3 draft=copy": (target, {"model": str(perturbed_copy(
                target, root / "copy", 0.0)), "num_speculative_tokens": k}),
            "qwen3 draft=noisy": (target, {"model": str(perturbed_copy(
                target, root / "noisy", 0.1, seed=1)), "num_speculative_tokens": k}),
            "qwen3.5 off": (hybrid, None),
            "qwen3.5 mtp (random)": (hybrid, {"method": "mtp", "num_speculative_tokens": k}),
        }
        prompt = [{"prompt_token_ids": tiny_models.random_prompts(1, 20, 21, 512, seed=3)[0]}]
        sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        llms = {name: LLM(str(m), max_model_len=256, speculative_config=c)
                for name, (m, c) in cases.items()}
        best: dict[str, float] = {}
        toks: dict[str, list[int]] = {}
        for _ in range(args.repeats):
            for name, llm in llms.items():
                t0 = time.perf_counter()
                out = llm.generate(prompt, sp, use_tqdm=False)
                best[name] = min(best.get(name, 1e9), time.perf_counter() - t0)
                toks[name] = out[0].outputs[0].token_ids
        print(f"{'case':22s} {'tok/s':>8s} {'vs off':>7s}  same  acceptance")
        for name, llm in llms.items():
            off = name.split(" ")[0] + " off"
            s = llm.engine.spec
            acc = (f"{100 * s.metrics.acceptance_rate:.0f}%, mean len "
                   f"{s.metrics.mean_accepted_length:.2f}" if s else "-")
            print(f"{name:22s} {args.max_tokens / best[name]:8.1f} "
                  f"{best[off] / best[name]:7.2f}  {str(toks[name] == toks[off]):5s} {acc}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
