"""FP8 KV cache quality on the trained SmolLM2-135M-Instruct, against the bf16 cache.

    python -m benchmarks.kv_fp8

Rows: the bf16 cache (reference), FP8 as pagefold stores it (per-head scales and K mean shift
calibrated on the first batch, saturating casts) and a plain e4m3 cast (unit scales, no
shift: what the cache did before). Columns: mean / max KL divergence of the next-token
distributions over ``pagefold.testing.kv_quality.SAMPLE_TEXT`` (teacher-forced; prefill in
``--chunk``-token chunks, so later chunks read earlier ones back from the cache), top-1
agreement, and the greedy answer to "What is the capital of France?" (one prefill chunk).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--chunk", type=int, default=48, help="prefill chunk (max batched tokens)")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.common import print_table
    from pagefold import LLM, SamplingParams
    from pagefold.models.smollm2 import smollm2_checkpoint
    from pagefold.ops.attention import kv_quant
    from pagefold.testing.kv_quality import SAMPLE_TEXT, mean_kl, prompt_logprobs

    model = str(smollm2_checkpoint())
    question = [{"role": "user", "content": "What is the capital of France?"}]
    calibrate = kv_quant.KVScales.calibrate
    rows, ref = [], None
    for name, kv in (("bf16 cache", "auto"), ("fp8 (pagefold)", "fp8"),
                     ("fp8 plain cast", "fp8")):
        if name == "fp8 plain cast":
            kv_quant.KVScales.calibrate = classmethod(
                lambda cls, k, v, dt: cls.unit(k.shape[1], k.shape[2], k.device))
        try:
            kw = dict(kv_cache_dtype=kv, kv_cache_memory="32MiB", max_model_len=512,
                      enable_prefix_caching=False, warm_up=False)
            llm = LLM(model, max_num_batched_tokens=512, **kw)
            answer = llm.chat(question, SamplingParams(temperature=0, max_tokens=12),
                              use_tqdm=False)[0].outputs[0].text
            llm = LLM(model, max_num_batched_tokens=args.chunk, **kw)
            lp = prompt_logprobs(llm, llm.get_tokenizer().encode(SAMPLE_TEXT))
        finally:
            kv_quant.KVScales.calibrate = calibrate
        if ref is None:
            ref = lp
        kl = mean_kl(ref, lp)
        agree = (lp.argmax(-1) == ref.argmax(-1)).float().mean().item()
        rows.append({"kv cache": name, "tokens": lp.shape[0],
                     "mean KL": f"{kl.mean().item():.5f}", "max KL": f"{kl.max().item():.4f}",
                     "top-1 agree": f"{agree:.3f}",
                     "capital answer": repr(answer)})
    print_table(rows, list(rows[0]))


if __name__ == "__main__":
    main()
