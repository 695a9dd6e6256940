"""Pipeline parallelism on the CPU (gloo; 2 stages, of 1 or 2 tensor-parallel ranks each)
against transformers in float32.

One engine per architecture kind -- dense (Llama), Gated DeltaNet (Qwen3.5), Mamba-2 hybrid
(Nemotron-H), MoE (Qwen3-Next) -- runs prompts sharing a prefix under chunked prefill at an odd
budget and a pool small enough to preempt, twice (the second pass hits the prefix cache and
aborts a request while its message is in flight), with two step messages in flight, and
must reproduce ``hf_greedy`` token for token. Every rank's pool must be its stage's pool as
``pagefold capacity --pipeline-parallel-size 2`` reports it. Killing a stage's rank must end
the engine with an error naming it, never a hang.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

from pagefold import LLM, SamplingParams
from pagefold.checkpoint import load_hf_config, text_config
from pagefold.core.capacity import capacity_report
from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_cache_planner import plan_stages
from pagefold.core.kv_cache_spec import FullAttentionSpec
from pagefold.core.spec_from_config import layer_specs_from_config
from pagefold.distributed import pipeline
from pagefold.distributed.executor import TPWorkerError
from pagefold.distributed.pipeline import (
    ENV_PARTITION,
    layer_costs,
    partition_layers,
    split_for,
)
from pagefold.entrypoints import capacity_cmd
from pagefold.testing.oracle import hf_greedy
from pagefold.testing.tiny_models import random_prompts

NEW = 8
MAX_LEN = 128
PREFIX = random_prompts(1, 40, 40, 500, seed=7)[0]
PROMPTS = [PREFIX + t for t in random_prompts(5, 3, 30, 500, seed=3)]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)

# (tiny model, config overrides, layer partition override or None: the balanced split,
# blocks above one request of MAX_LEN: few enough that requests get preempted). Llama gets 4
# layers split 1 + 3: stages of unequal pools (the scheduler's block count is the fuller
# stage's). Nemotron-H's requests (checkpoints captured inside chunks) preempt at 4, not 3.
KINDS = {
    "dense": ("llama", dict(num_hidden_layers=4), "1,3", 3),
    "gdn": ("qwen3_5", {}, None, 3),
    "mamba2": ("nemotron_h", {}, None, 4),
    "moe": ("qwen3_next", {}, None, 3),
}


def test_partition_balances_the_largest_stage():
    assert partition_layers([1, 1, 1, 5], 2) == [(0, 3), (3, 4)]
    assert partition_layers([5, 1, 1, 1], 2) == [(0, 1), (1, 4)]
    assert partition_layers([2, 2, 2, 2], 2) == [(0, 2), (2, 4)]
    assert partition_layers([3, 1, 1, 1, 3], 3) == [(0, 1), (1, 4), (4, 5)]
    assert partition_layers([1, 1, 1], 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="at least that many decoder layers"):
        partition_layers([1, 1], 3)


def test_split_weighs_layers_by_parameters_and_obeys_the_override(tiny_model_factory,
                                                                  monkeypatch):
    """Qwen3.5's tiny stack (GDN, GDN, GDN, attention: unequal layers): the split is the one
    balancing the layers' parameter counts; the environment override wins and is checked."""
    arch, cfg = load_hf_config(str(tiny_model_factory("qwen3_5", num_hidden_layers=8)))
    tcfg = text_config(cfg)
    costs = layer_costs(arch, tcfg)
    assert len(costs) == 8 and len(set(costs)) > 1  # attention and GDN layers differ
    monkeypatch.delenv(ENV_PARTITION, raising=False)
    spans = split_for(arch, tcfg, 2)
    cut = spans[0][1]
    worst = max(sum(costs[:cut]), sum(costs[cut:]))
    assert worst == min(max(sum(costs[:c]), sum(costs[c:])) for c in range(1, 8))
    monkeypatch.setenv(ENV_PARTITION, "3,5")
    assert split_for(arch, tcfg, 2) == [(0, 3), (3, 8)]
    for bad in ("3,4", "8,0", "2,3,3", "a,b"):
        monkeypatch.setenv(ENV_PARTITION, bad)
        with pytest.raises(ValueError, match=ENV_PARTITION):
            split_for(arch, tcfg, 2)


def test_stage_pools_hold_only_their_layers():
    """Each stage keeps the model's groups with its own layers; its tensors are as many as
    its fullest group's layers; every stage and the scheduler get the fewest blocks."""
    attn = FullAttentionSpec(num_kv_heads=2, head_dim=8, dtype=torch.float32)
    specs = {f"layers.{i}": attn for i in range(4)}
    sched, (s0, s1) = plan_stages(specs, 16, 1 << 20, [(0, 1), (1, 4)])
    page = sched.page_bytes
    assert [g.layer_names for g in s0.groups] == [("layers.0",)]
    assert [g.layer_names for g in s1.groups] == [("layers.1", "layers.2", "layers.3")]
    assert (s0.layers_per_group, s1.layers_per_group) == (1, 3)
    assert s0.num_blocks == s1.num_blocks == sched.num_blocks == (1 << 20) // (3 * page)
    assert sched.groups[0].layer_names == tuple(specs)
    # A layer's own caches (Falcon-H1's parallel ``layers.{i}.attn`` / ``.mamba``) go with it.
    _, (t0, t1) = plan_stages({"layers.0.attn": attn, "layers.1.attn": attn}, 16, 1 << 20,
                              [(0, 1), (1, 2)])
    assert ([g.layer_names for g in t0.groups], [g.layer_names for g in t1.groups]) == (
        [("layers.0.attn",)], [("layers.1.attn",)])


def test_model_without_decoder_stack_is_refused(tiny_model_factory, monkeypatch):
    """A model not built through the shared DecoderStack is a clear error naming its
    architecture, before any worker starts (every registered model builds through it now)."""
    arch, cfg = load_hf_config(str(tiny_model_factory("llama")))
    monkeypatch.setattr(pipeline, "model_class",
                        lambda name: lambda tcfg, max_positions: torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=f"pipeline parallelism is not supported for {arch}"):
        layer_costs(arch, text_config(cfg))


@pytest.mark.parametrize("model", ["llama", "qwen3_5"])
def test_capacity_weights_per_stage_match_the_checkpoint(tiny_model_factory, capsys, model):
    """``pagefold capacity -pp 2``'s weight bytes per stage equal the checkpoint's tensors of
    the stage's layers (read from the safetensors files), with the embeddings on the first
    stage (and on the last too when tied) and the final norm and head on the last."""
    import re

    from safetensors import safe_open

    model_dir = tiny_model_factory(model)
    capsys.readouterr()
    assert capacity_cmd.main([str(model_dir), "--kv-cache-memory", str(1 << 24),
                              "--max-model-len", str(MAX_LEN), "--dtype", "float32", "-pp", "2",
                              "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    spans = [(a, b + 1) for a, b in (st["layers"] for st in rep["pipeline"]["stages"])]
    _, cfg = load_hf_config(str(model_dir))
    tied = bool(getattr(text_config(cfg), "tie_word_embeddings", False))
    want = [0] * len(spans)
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for name in sf.keys():
                if name.startswith("mtp."):
                    continue  # the MTP head is not built without speculation
                n = sf.get_slice(name).get_shape()
                nbytes = 4 * int(torch.tensor(n).prod()) if n else 4
                m = re.search(r"\.layers\.(\d+)\.", name)
                if m:
                    i = int(m.group(1))
                    want[next(k for k, (a, b) in enumerate(spans) if a <= i < b)] += nbytes
                elif "embed_tokens" in name:
                    want[0] += nbytes
                    if tied:
                        want[-1] += nbytes
                else:
                    want[-1] += nbytes  # final norm, lm_head
    assert rep["weights"]["per_stage"] == want
    assert rep["weights"]["bytes"] == max(want)


def _small_pool(model_dir, tp: int, extra: int) -> int:
    """Per-rank bytes whose stage pools hold a little over one request of MAX_LEN, so that
    concurrent requests get preempted."""
    arch, cfg = load_hf_config(str(model_dir))
    specs = layer_specs_from_config(cfg, model_dtype=torch.float32, tensor_parallel_size=tp)
    spans = split_for(arch, text_config(cfg), 2, tp)
    sched, stages = plan_stages(specs, 16, 1 << 24, spans)
    rep = capacity_report(specs, layout="pagefold", memory_bytes=1 << 24, max_model_len=MAX_LEN,
                          block_size=16, enable_prefix_caching=True)
    one = max(rep["blocks_per_request"], KVCacheManager(sched).min_blocks_for(MAX_LEN))
    return (one + extra) * max(s.layers_per_group for s in stages) * sched.page_bytes


def _capacity_stages(model_dir, memory: int, tp: int, capsys) -> list[dict]:
    capsys.readouterr()
    assert capacity_cmd.main([str(model_dir), "--kv-cache-memory", str(memory),
                              "--max-model-len", str(MAX_LEN), "--dtype", "float32",
                              "--enable-prefix-caching", "-tp", str(tp), "-pp", "2",
                              "--json"]) == 0
    return json.loads(capsys.readouterr().out)["pipeline"]["stages"]



def _pass_with_abort_in_flight(eng, ref: list[list[int]]) -> None:
    """The prompts again (prefix hits), stepped by hand with one more request that is aborted
    while its message is in flight (its result is dropped when collected); a new request
    takes its id at once, with ``PROMPTS[2]``."""
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"p{i}", p, GREEDY)
    eng.add_request("gone", PROMPTS[1][:25], GREEDY)
    got: dict[str, list[int]] = {}
    aborted = False
    while eng.has_unfinished():
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        if not aborted and "gone" in eng.scheduler.in_flight:
            eng.abort(["gone"])
            got.pop("gone", None)
            eng.add_request("gone", PROMPTS[2], GREEDY)
            aborted = True
    assert aborted
    want = {f"p{i}": r for i, r in enumerate(ref)} | {"gone": ref[2]}
    bad = sorted(k for k in want if got.get(k) != want[k])
    assert not bad, f"{bad} differ from transformers"
    assert not eng.scheduler.in_flight
    eng.flush()


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", list(KINDS))
def test_pp2_greedy_matches_transformers(tiny_model_factory, monkeypatch, capsys, kind, tp):
    arch, overrides, partition, extra = KINDS[kind]
    model_dir = tiny_model_factory(arch, **overrides)
    if partition:
        monkeypatch.setenv(ENV_PARTITION, partition)
    else:
        monkeypatch.delenv(ENV_PARTITION, raising=False)
    memory = _small_pool(model_dir, tp, extra)
    ref = hf_greedy(model_dir, PROMPTS, NEW)
    llm = LLM(str(model_dir), pipeline_parallel_size=2, tensor_parallel_size=tp,
              max_model_len=MAX_LEN, kv_cache_memory=memory, max_num_batched_tokens=13,
              threads_per_rank=1)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        bad = [i for i, (g, r) in enumerate(zip(got, ref)) if g != r]
        assert not bad, f"prompts {bad} differ from transformers"
        llm.engine.kv.check_whole()
        _pass_with_abort_in_flight(llm.engine, ref)
        llm.engine.kv.check_whole()
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.kv.stats.hits > 0  # the second pass (and shared prefixes) hit
        assert llm.engine.batches.peak == 2  # two step messages were in flight at once
        # Every rank's pool is its stage's as `pagefold capacity -pp 2` reports it.
        stages = _capacity_stages(model_dir, memory, tp, capsys)
        want = [{"num_blocks": s["num_blocks"], "pool_bytes": s["pool_bytes"]}
                for s in stages for _ in range(tp)]
        assert llm.engine.runner.rank_pools == want
        assert llm.engine.kv_config.num_blocks == stages[0]["num_blocks"]
        if partition:
            assert [s["layers"] for s in stages] == [[0, 0], [1, 3]]
            assert stages[0]["pool_bytes"] * 3 == stages[1]["pool_bytes"]
        if kind != "dense" or tp != 1:
            return
        # Killing the first stage's rank (the last one waits for its hidden states) is an
        # engine error naming it, well within the test's time.
        os.kill(llm.engine.runner.pids[0], signal.SIGKILL)
        t = time.monotonic()
        with pytest.raises(TPWorkerError, match="rank 0"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
        assert time.monotonic() - t < 60
    finally:
        llm.engine.shutdown()


# Stacks with their own hooks: scaled embeddings and a tied head (Gemma 3), parallel
# attention + Mamba-2 caches named ``layers.{i}.attn`` / ``.mamba`` (Falcon-H1), a float32
# residual stream handed between stages and its own head (Mamba), the native-step stack with
# an embedding multiplier (Granite-4.0-H), the embeddings as the second stream and shared
# blocks held by every stage that uses them (Zamba2). One pass each, no pool pressure.
HOOKED = ["gemma3", "falcon_h1", "mamba", "granitemoehybrid", "zamba2"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", HOOKED)
def test_pp2_stack_hooks_match_transformers(tiny_model_factory, arch):
    model_dir = tiny_model_factory(arch)
    ref = hf_greedy(model_dir, PROMPTS[:3], NEW)
    llm = LLM(str(model_dir), pipeline_parallel_size=2, max_model_len=MAX_LEN,
              kv_cache_memory=1 << 22, max_num_batched_tokens=13, threads_per_rank=1)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], GREEDY,
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
    finally:
        llm.engine.shutdown()
