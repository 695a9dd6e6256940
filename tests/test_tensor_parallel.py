"""Tensor parallelism on the CPU (gloo, 2 worker ranks) against transformers in float32.

Architectures with tensor-parallel shards: Llama, Qwen2, Qwen3 (attention + gated MLP),
Qwen3.5 (Gated DeltaNet heads and their states, gated attention), Nemotron-H and Bamba
(Mamba-2 heads and B/C groups with their states, NoPE / partial-RoPE attention, relu^2 or
gated MLPs). MoE experts are not split yet: those configs are refused with a clear error.

One engine per architecture runs prompts sharing a prefix under chunked prefill at an odd
budget and a pool small enough to preempt, twice (the second pass hits the prefix cache), and
must reproduce ``hf_greedy`` token for token. Each rank's pool must be what the capacity
planner computes for ``--tensor-parallel-size 2``. Killing a rank must end the engine with an
error naming it, never a hang.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from pagefold import LLM, SamplingParams
from pagefold.core.capacity import capacity_report
from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_cache_planner import plan_pagefold
from pagefold.core.spec_from_config import layer_specs_from_config
from pagefold.distributed.executor import TPWorkerError
from pagefold.testing.oracle import hf_greedy
from pagefold.testing.tiny_models import random_prompts

pytestmark = pytest.mark.slow

NEW = 8
MAX_LEN = 128
PREFIX = random_prompts(1, 40, 40, 500, seed=7)[0]
PROMPTS = [PREFIX + t for t in random_prompts(5, 3, 30, 500, seed=3)]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def _config(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


# Blocks above one request of MAX_LEN: enough that requests share the pool (and the prefix
# cache keeps checkpoints), few enough that they get preempted. Bamba's large states need more;
# Nemotron-H's (checkpoints captured inside chunks, no cuts) preempt at 4 (not at 3 or 5).
EXTRA_BLOCKS = {"bamba": 10, "nemotron_h": 4}


def _small_pool(cfg: dict, tp: int, extra: int = 3) -> int:
    """Bytes of a pool just over one request of MAX_LEN: concurrent requests get preempted."""
    import torch

    specs = layer_specs_from_config(cfg, model_dtype=torch.float32, tensor_parallel_size=tp)
    plan = plan_pagefold(specs, 16, 1 << 24)
    rep = capacity_report(specs, layout="pagefold", memory_bytes=1 << 24, max_model_len=MAX_LEN,
                          block_size=16, enable_prefix_caching=True)
    one = max(rep["blocks_per_request"], KVCacheManager(plan).min_blocks_for(MAX_LEN))
    return (one + extra) * plan.layers_per_group * plan.page_bytes


def _run(model_dir, llm: LLM) -> None:
    ref = hf_greedy(model_dir, PROMPTS, NEW)
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        bad = [i for i, (g, r) in enumerate(zip(got, ref)) if g != r]
        assert not bad, f"prompts {bad} differ from transformers"
        llm.engine.kv.check_whole()
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.stats.hits > 0  # the second pass (and shared prefixes) hit


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_5", "nemotron_h", "bamba"])
def test_tp2_greedy_matches_transformers(tiny_model_factory, arch: str):
    model_dir = tiny_model_factory(arch)
    cfg = _config(model_dir)
    memory = _small_pool(cfg, 2, EXTRA_BLOCKS.get(arch, 3))
    llm = LLM(str(model_dir), tensor_parallel_size=2, max_model_len=MAX_LEN,
              kv_cache_memory=memory, max_num_batched_tokens=13, threads_per_rank=1)
    captures = [0]
    if arch in ("qwen3_5", "nemotron_h", "bamba"):
        # State checkpoints inside chunks travel in the step message to every rank.
        assert llm.engine.runner.captures_in_kernel and llm.engine.kv.capture_in_kernel
        execute = llm.engine.runner.execute

        def counting(out):
            captures[0] += len(out.captures)
            return execute(out)

        llm.engine.runner.execute = counting
    try:
        _run(model_dir, llm)
        assert (captures[0] > 0) == (arch in ("qwen3_5", "nemotron_h", "bamba"))
        if arch != "llama":
            return
        # Per-rank pools: exactly the planner's TP arithmetic (what `pagefold capacity
        # --tensor-parallel-size 2` reports), the same on every rank.
        import torch

        specs = layer_specs_from_config(cfg, model_dtype=torch.float32, tensor_parallel_size=2)
        rep = capacity_report(specs, layout="pagefold", memory_bytes=memory,
                              max_model_len=MAX_LEN, block_size=16, enable_prefix_caching=True)
        want = {"num_blocks": rep["num_blocks"], "pool_bytes": rep["pool_bytes"]}
        assert llm.engine.runner.rank_pools == [want, want]
        assert llm.engine.kv_config.num_blocks == rep["num_blocks"]
        # Killing one rank is an engine error naming it, well within the test's time.
        os.kill(llm.engine.runner.pids[1], signal.SIGKILL)
        t = time.monotonic()
        with pytest.raises(TPWorkerError, match="rank"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
        assert time.monotonic() - t < 60
    finally:
        llm.engine.shutdown()


def test_heads_not_dividing_name_the_field(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM(str(model_dir), tensor_parallel_size=3, max_model_len=MAX_LEN,
            kv_cache_memory=1 << 22)


def test_moe_is_refused_clearly(tiny_model_factory):
    with pytest.raises(ValueError, match="not supported for GraniteMoeHybridForCausalLM"):
        LLM(str(tiny_model_factory("granitemoehybrid")), tensor_parallel_size=2,
            max_model_len=MAX_LEN, kv_cache_memory=1 << 22)
