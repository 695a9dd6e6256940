"""Tensor parallelism on the CPU (gloo, 2 worker ranks) against transformers in float32.

Architectures with tensor-parallel shards: Llama, Qwen2, Qwen3 (attention + gated MLP), Qwen3.5
(Gated DeltaNet heads and their states, gated attention), Qwen3-Next and Qwen3.5-MoE (the same
+ sparse MoE with a gated shared expert), Nemotron-H (with and without its MoE blocks), Bamba
and Granite-4.0-H (Mamba-2 heads and B/C groups with their states -- Granite's single group
shared by the ranks --, NoPE / partial-RoPE attention, relu^2 / gated MLPs, stacked Granite
experts), Gemma 3 (sliding + full attention, one KV head replicated), Mamba-2, Falcon-H1
(parallel attention + Mamba-2 with per-channel multipliers), LFM2 (short-conv channels),
gpt-oss (attention sinks per head, biased interleaved experts), MiniMax (lightning heads and
their states, an output norm spanning the ranks), Jamba, Mamba and Falcon-Mamba (Mamba-1
channels, row-parallel x_proj, Falcon-Mamba's dt/B/C norms over the reduced vectors) and Kimi
Linear (KDA heads, MLA query heads over a shared latent), Zamba2 (shared blocks with LoRA
adapters cut like the projections they add to) and Llama-4 (chunked local and NoPE attention
heads, input-scaled experts and a shared expert summed in one all-reduce). MoE experts split
their intermediate dimension over the ranks. Fields that do not divide are named before any
worker starts.

One engine per architecture runs prompts sharing a prefix under chunked prefill at an odd
budget and a pool small enough to preempt, twice (the second pass hits the prefix cache), and
must reproduce ``hf_greedy`` token for token. Each rank's pool must be what the capacity
planner computes for ``--tensor-parallel-size 2``. Killing a rank must end the engine with an
error naming it, never a hang.

Expert parallelism (``enable_expert_parallel``, whole experts per rank, exact combine) runs the
same scenario on the MoE architectures that support it, and each rank must hold exactly the
weight bytes ``pagefold capacity --enable-expert-parallel`` reports; unsupported architectures
and expert counts that do not divide are refused before any worker starts.
"""

from __future__ import annotations

import dataclasses
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
# cache keeps checkpoints), few enough that they get preempted. Large states need more.
# Nemotron-H's (checkpoints captured inside chunks, no cuts) preempts at 4 (not at 3 or 5).
EXTRA_BLOCKS = {"bamba": 10, "nemotron_h_moe": 4, "granitemoehybrid": 10, "mamba2": 1,
                "falcon_h1": 6, "gemma3": 1, "mamba": 1, "falcon_mamba": 1,
                "llama4": 1}
# Gemma 3's sliding and Llama-4's chunked layers free their old pages, so requests hold far
# less than the pool floor (one request of max_model_len, counted as if nothing slid): a
# shorter max_model_len (still above every prompt + NEW) keeps the pool small enough to preempt.
MAX_LENS = {"gemma3": 80, "llama4": 80}
# Checkpoints whose zero-initialised biases are made random, so a bias added on every rank
# (instead of once) would change the tokens.
RANDOM_BIASES = {"gpt_oss", "mamba"}
# A state-only model's requests never grow, so nothing is ever preempted to make room.
NEVER_PREEMPTED = {"mamba2", "mamba", "falcon_mamba"}
# Models whose GDN / Mamba-2 kernels capture state checkpoints inside prefill chunks.
CAPTURING = {"qwen3_5", "nemotron_h_moe", "bamba"}

# Config overrides so heads divide by 2 (the tiny configs use 3 / 5 heads on purpose).
NEMOTRON_MOE = dict(
    layers_block_type=["linear_attention", "moe", "full_attention", "moe", "linear_attention",
                       "mlp"],
    n_routed_experts=8, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
    num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=1.5,
    moe_latent_size=24)
OVERRIDES = {
    "gemma3": dict(num_attention_heads=4),
    "gpt_oss": dict(num_attention_heads=4),
    "zamba2": dict(n_mamba_heads=4),
    "kimi_linear": dict(num_attention_heads=4, num_key_value_heads=4, linear_num_heads=4),
    "falcon_h1": dict(num_attention_heads=4, mamba_n_heads=6, mamba_d_head=10),
    "nemotron_h_moe": NEMOTRON_MOE,
}


def _small_pool(cfg: dict, tp: int, extra: int = 3, max_len: int = MAX_LEN) -> int:
    """Bytes of a pool just over one request of MAX_LEN: concurrent requests get preempted."""
    import torch

    specs = layer_specs_from_config(cfg, model_dtype=torch.float32, tensor_parallel_size=tp)
    plan = plan_pagefold(specs, 16, 1 << 24)
    rep = capacity_report(specs, layout="pagefold", memory_bytes=1 << 24, max_model_len=max_len,
                          block_size=16, enable_prefix_caching=True)
    one = max(rep["blocks_per_request"], KVCacheManager(plan).min_blocks_for(max_len))
    return (one + extra) * plan.layers_per_group * plan.page_bytes


def _run(model_dir, llm: LLM, preempts: bool = True) -> None:
    ref = hf_greedy(model_dir, PROMPTS, NEW)
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        bad = [i for i, (g, r) in enumerate(zip(got, ref)) if g != r]
        assert not bad, f"prompts {bad} differ from transformers"
        llm.engine.kv.check_whole()
    assert llm.engine.scheduler.num_preemptions > 0 or not preempts
    assert llm.engine.kv.stats.hits > 0  # the second pass (and shared prefixes) hit


# Nemotron-H runs with MoE blocks (its Mamba-2, attention and MLP blocks as well).
TP_ARCHS = ["llama", "qwen2", "qwen3", "qwen3_5", "qwen3_next", "qwen3_5_moe", "nemotron_h_moe",
            "bamba", "granitemoehybrid", "gemma3", "mamba2", "falcon_h1", "lfm2", "gpt_oss",
            "minimax", "jamba", "kimi_linear", "zamba2", "mamba", "falcon_mamba", "llama4"]


def _with_random_biases(src, dst):
    """A copy of the model in ``src`` whose all-zero ``*bias`` tensors are random."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    for name, t in weights.items():
        if "bias" in name and not t.any():
            weights[name] = 0.2 * torch.randn(t.shape, generator=gen)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("arch", TP_ARCHS)
def test_tp2_greedy_matches_transformers(tiny_model_factory, tmp_path, arch: str):
    model_dir = tiny_model_factory(arch.removesuffix("_moe"), **OVERRIDES.get(arch, {}))
    if arch in RANDOM_BIASES:
        model_dir = _with_random_biases(model_dir, tmp_path / arch)
    cfg = _config(model_dir)
    max_len = MAX_LENS.get(arch, MAX_LEN)
    memory = _small_pool(cfg, 2, EXTRA_BLOCKS.get(arch, 3), max_len)
    llm = LLM(str(model_dir), tensor_parallel_size=2, max_model_len=max_len,
              kv_cache_memory=memory, max_num_batched_tokens=13, threads_per_rank=1)
    captures = [0]
    if arch in CAPTURING:
        # State checkpoints inside chunks travel in the step message to every rank.
        assert llm.engine.runner.captures_in_kernel and llm.engine.kv.capture_in_kernel
        execute = llm.engine.runner.execute

        def counting(out):
            captures[0] += len(out.captures)
            return execute(out)

        llm.engine.runner.execute = counting
    try:
        _run(model_dir, llm, preempts=arch not in NEVER_PREEMPTED)
        assert captures[0] > 0 or arch not in CAPTURING
        # Per-rank pools: exactly the planner's TP arithmetic (what `pagefold capacity
        # --tensor-parallel-size 2` reports), the same on every rank.
        import torch

        specs = layer_specs_from_config(cfg, model_dtype=torch.float32, tensor_parallel_size=2)
        rep = capacity_report(specs, layout="pagefold", memory_bytes=memory,
                              max_model_len=max_len, block_size=16, enable_prefix_caching=True)
        want = {"num_blocks": rep["num_blocks"], "pool_bytes": rep["pool_bytes"]}
        assert llm.engine.runner.rank_pools == [want, want]
        assert llm.engine.kv_config.num_blocks == rep["num_blocks"]
        if arch != "llama":
            return
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


@pytest.mark.parametrize(("arch", "overrides", "field"), [
    ("qwen3_next", dict(moe_intermediate_size=33), "moe_intermediate_size"),
    ("qwen3_next", dict(shared_expert_intermediate_size=45), "shared_expert_intermediate_size"),
    ("granitemoehybrid", dict(shared_intermediate_size=45), "shared_intermediate_size"),
    ("mamba2", dict(n_groups=5), "n_groups"),
    ("falcon_h1", dict(num_attention_heads=4), "heads"),
    ("gemma3", {}, "num_attention_heads"),
])
def test_fields_not_dividing_are_named_before_workers_start(tiny_model_factory, arch, overrides,
                                                            field):
    """The shard check runs in the engine process (rank 0's shard on the meta device), so the
    error is a ValueError naming the field, and no worker starts."""
    with pytest.raises(ValueError, match=rf"{field} \(\d+\) (is not divisible|must be 1)"):
        LLM(str(tiny_model_factory(arch, **overrides)), tensor_parallel_size=2,
            max_model_len=MAX_LEN, kv_cache_memory=1 << 22)


def test_architectures_without_shards_are_refused(monkeypatch):
    """Every registered architecture has shards today; one without them is refused naming the
    part that does not split (or as unknown), before anything is sized."""
    from transformers import LlamaConfig

    from pagefold import architectures
    from pagefold.engine import core

    assert (architectures.tensor_parallel_architectures()
            == architectures.served_architectures())
    cfg = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    with pytest.raises(ValueError, match="not supported for FooForCausalLM yet"):
        core.check_tensor_parallel("FooForCausalLM", cfg, 2)
    llama = architectures.ARCHITECTURES["LlamaForCausalLM"]
    monkeypatch.setitem(architectures.ARCHITECTURES, "LlamaForCausalLM",
                        dataclasses.replace(llama, tensor_parallel="its widgets do not split"))
    with pytest.raises(ValueError, match="LlamaForCausalLM: its widgets do not split"):
        core.check_tensor_parallel("LlamaForCausalLM", cfg, 2)


# Expert parallelism: the MoE architectures that place whole experts on ranks. One engine per
# architecture (each spawns 2 ranks) runs the same chunked / preempted / prefix-hit scenario.
# Expert counts: qwen3_next, granite, minimax and kimi 4, qwen3_5_moe 6 (tiny defaults); jamba's
# and gpt-oss's 5 (which EP=2 refuses) made 4.
EP_ARCHS = ["qwen3_next", "granitemoehybrid", "jamba", "gpt_oss", "qwen3_5_moe", "minimax",
            "kimi_linear"]
EP_OVERRIDES = {"jamba": dict(num_experts=4),
                "gpt_oss": dict(OVERRIDES["gpt_oss"], num_local_experts=4)}


@pytest.mark.parametrize("arch", EP_ARCHS)
def test_ep2_greedy_matches_transformers(tiny_model_factory, tmp_path, arch: str):
    """TP=2 with enable_expert_parallel: tokens equal transformers' in every scenario, and
    each rank holds exactly the weights ``pagefold capacity --enable-expert-parallel`` counts
    (its half of the experts, whole), less than a rank holds without EP wherever experts carry
    per-expert tensors that tensor parallelism replicates (gpt-oss's down biases)."""
    import torch

    from pagefold.checkpoint import load_hf_config
    from pagefold.models.footprint import weight_bytes

    model_dir = tiny_model_factory(arch, **EP_OVERRIDES.get(arch, OVERRIDES.get(arch, {})))
    if arch in RANDOM_BIASES:
        model_dir = _with_random_biases(model_dir, tmp_path / arch)
    cfg = _config(model_dir)
    memory = _small_pool(cfg, 2, EXTRA_BLOCKS.get(arch, 3))
    llm = LLM(str(model_dir), tensor_parallel_size=2, enable_expert_parallel=True,
              max_model_len=MAX_LEN, kv_cache_memory=memory, max_num_batched_tokens=13,
              threads_per_rank=1)
    try:
        _run(model_dir, llm)
        name, hf_config = load_hf_config(str(model_dir))
        ep, _ = weight_bytes(model_dir, hf_config, name, torch.float32,
                             tensor_parallel_size=2, expert_parallel=True)
        tp, _ = weight_bytes(model_dir, hf_config, name, torch.float32, tensor_parallel_size=2)
        assert llm.engine.runner.rank_params == [ep // 4, ep // 4]
        assert ep < tp if arch == "gpt_oss" else ep == tp
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize(("arch", "overrides", "match"), [
    ("qwen3_5_moe", dict(num_experts=5), r"num_experts \(5\) is not divisible by the "
                                         r"expert-parallel size 2"),
    ("gpt_oss", dict(num_attention_heads=4, num_local_experts=3),
     r"num_local_experts \(3\) is not divisible by the expert-parallel size 2"),
    ("llama4", {}, "enable_expert_parallel is not supported for Llama4ForCausalLM"),
])
def test_expert_parallel_refusals_before_workers_start(tiny_model_factory, arch, overrides,
                                                       match):
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny_model_factory(arch, **overrides)), tensor_parallel_size=2,
            enable_expert_parallel=True, max_model_len=MAX_LEN, kv_cache_memory=1 << 22)
