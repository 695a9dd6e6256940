"""Decode steps over the static, padded batch that CUDA graphs replay, checked on the CPU.

``capture=False`` runs exactly the padded static step a graph would replay, eagerly, with the
Triton kernels under the interpreter: its tokens must equal transformers', and padding rows
must not change one byte of the pool (compared with an eager run of the same schedule).
"""

from __future__ import annotations

import pytest
import torch

from pagefold import LLM, SamplingParams
from pagefold.executor.cuda_graphs import bucket_for, capture_sizes
from pagefold.kernels import dispatch
from pagefold.testing.oracle import hf_greedy

dispatch.prepare_interpreter()  # before triton is first imported (no-op with CUDA)


def test_buckets():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]
    sizes = capture_sizes(20)
    assert [bucket_for(n, sizes) for n in (1, 3, 5, 9, 17, 24)] == [1, 4, 8, 16, 24, 24]
    assert bucket_for(25, sizes) is None


@pytest.fixture
def triton_mode():
    pytest.importorskip("triton")
    before = dispatch.mode()
    dispatch.set_mode("triton")
    yield
    dispatch.set_mode(before)


@pytest.mark.slow
def test_padded_static_decode_matches_eager_and_transformers(qwen3_5_dir, random_prompts,
                                                             triton_mode):
    prompts = random_prompts(3, 5, 12, 512, seed=31)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ref = hf_greedy(qwen3_5_dir, prompts, 4)
    runs = []
    for graphs in (False, True):
        llm = LLM(str(qwen3_5_dir), max_model_len=32, kv_cache_memory=1 << 20)
        runner = llm.engine.runner
        calls = {"n": 0}
        if graphs:
            runner.enable_cuda_graphs(max_batch=8, max_model_len=32, capture=False)
            real = runner.graphs.run

            def counting(*a, _real=real, _calls=calls, **k):
                out = _real(*a, **k)
                _calls["n"] += out is not None
                return out

            runner.graphs.run = counting
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
        llm.engine.kv.check_whole()
        if graphs:
            assert calls["n"] >= 3  # every decode step went through the bucket of 4
        runs.append([t.clone() for t in runner.cache.shared])
    for eager, padded in zip(*runs):
        assert torch.equal(eager, padded)  # padding rows wrote nothing anywhere
