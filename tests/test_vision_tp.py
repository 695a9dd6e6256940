"""Images under tensor parallelism (2 CPU ranks, gloo) against transformers, float32 greedy.

Each rank runs the replicated vision tower and takes rank 0's embeddings (a broadcast), so the
ranks' residual streams agree bit for bit; the text layers are sharded as usual. Qwen3.5
(M-RoPE, encoder output across chunks of 7) and Gemma 3 (bidirectional image tokens, 4 heads
split 2 + 2, chunks of 20 moved off the images) each run a prompt with two images and must
give transformers' tokens and logprobs.
"""

from __future__ import annotations

import pytest
import test_vision_gemma3 as gemma3
import test_vision_qwen3_5 as qwen

from pagefold import LLM
from pagefold.testing.tiny_vl_models import build_tiny_gemma3_vl, build_tiny_qwen3_5_vl

pytestmark = pytest.mark.slow

MODELS = {
    "qwen3_5": (build_tiny_qwen3_5_vl, {}, qwen, 7),
    "gemma3": (build_tiny_gemma3_vl, {"num_attention_heads": 4}, gemma3, 20),
}


@pytest.mark.parametrize("arch", list(MODELS))
def test_images_at_tp2_equal_transformers(tmp_path, arch: str) -> None:
    build, overrides, mod, chunk = MODELS[arch]
    model_dir = build(tmp_path / arch, **overrides)
    reference = mod.make_reference(model_dir)
    cases = [mod.CASES[2]]  # two images
    llm = LLM(str(model_dir), dtype="float32", tensor_parallel_size=2, max_model_len=128,
              kv_cache_memory=4 << 20, max_num_batched_tokens=chunk, threads_per_rank=1,
              warm_up=False)
    try:
        assert llm.engine.takes_images
        outs = llm.generate([mod._request(*c) for c in cases], mod.PARAMS, use_tqdm=False)
        for o, c in zip(outs, cases):
            mod._check(o.outputs[0], reference(*c))
    finally:
        llm.engine.shutdown()
