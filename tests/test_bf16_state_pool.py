"""State pools in bf16 (``mamba_ssm_dtype`` unset, a bf16 model): prefix caching captures
Mamba-2 checkpoints inside a prefill chunk and writes them into bf16 pages.

The compiled SSD scan stores float32 captures only; a bf16 state pool takes them through a
buffer cast when written. Differential, one request at a time: the first request (captures
written, no hit) is bitwise the run with prefix caching off (captures never change a kernel's
outputs, nor the chunking); the same prompt again and a prompt sharing its first 48 tokens
start from the checkpoints (cached tokens counted) and give the greedy tokens of the run
without caching (not the bits: a bf16 state rounds where a chunk ends, and a hit moves the
chunk ends); the pool is whole after each engine.
"""

from __future__ import annotations

import pytest

from pagefold import LLM, SamplingParams

ARCHS = ["mamba2", "bamba", "zamba2", "granitemoehybrid"]


def _prompts() -> list[list[int]]:
    shared = [(7 * i + 3) % 400 + 10 for i in range(48)]
    return [shared + [(11 * i + j) % 400 + 10 for i in range(n)] for j, n in ((1, 4), (2, 19))]


def _run(model_dir, caching: bool):
    llm = LLM(str(model_dir), dtype="bfloat16", max_model_len=128, kv_cache_memory=8 << 20,
              max_num_batched_tokens=13, enable_prefix_caching=caching)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    got = []
    a, b = _prompts()
    for p in (a, a, b):
        (o,) = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
        got.append((o.outputs[0].token_ids, o.outputs[0].logprobs, o.num_cached_tokens))
    llm.engine.kv.check_whole()
    return got


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_state_checkpoints(tiny_model_factory, arch):
    model_dir = tiny_model_factory(arch)
    off = _run(model_dir, caching=False)
    on = _run(model_dir, caching=True)
    assert on[0][2] == 0 and on[0][:2] == off[0][:2]  # captures change nothing
    assert on[1][2] >= 32 and on[2][2] >= 32, [r[2] for r in on]
    assert [r[0] for r in on] == [r[0] for r in off]
