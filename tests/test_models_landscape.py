"""The seed's other families end to end against transformers (float32, greedy).

One parametrised scenario set per architecture, each on a tiny random model whose test config
has every layer kind of its family and shapes that are not powers of two:

* ``batch``: 6 prompts of 5..50 tokens together in an ample pool;
* ``chunk7``: chunked prefill at 7 tokens per step, prefill chunks mixed with decodes;
* ``preempt``: a pool that holds one request at max_model_len, chunked at 33 tokens, once
  with recompute and once with swap; two running requests are also preempted mid-decode on
  purpose (a state-only model never outgrows its pool), models with growing KV preempt on
  their own as well; states and pages come back exact;
* ``prefix``: prompts sharing a 40-token prefix, checkpoints every block, run twice: the second
  run is served from the cache (hits counted) and still equals transformers;
* ``fork``: n=2 greedy children equal each other and transformers.

Every scenario checks the pool is whole afterwards. ``test_capacity_matches_engine``: the
capacity planner, reading config.json alone, describes exactly the pool the engine builds.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from pagefold import LLM, SamplingParams
from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_cache_planner import (
    group_pages_for_request,
    pages_for_request,
    plan_pagefold,
)
from pagefold.core.kv_cache_spec import is_attention
from pagefold.core.spec_from_config import layer_specs_from_config
from pagefold.core.vllm_layout import plan_vllm
from pagefold.entrypoints.capacity_cmd import main as capacity_main
from pagefold.testing.oracle import hf_greedy

N_NEW, VOCAB, MAX_LEN = 6, 512, 50
MAX_MODEL_LEN = 72
ARCHS = ["mamba2", "gemma3", "gpt_oss", "lfm2", "falcon_h1", "zamba2", "jamba", "minimax",
         "kimi_linear", "mamba", "falcon_mamba", "llama4"]
SCENARIOS = ["batch", "chunk7", "preempt", "prefix", "fork"]
GREEDY = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)


def _inputs(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def _specs(model_dir: Path):
    import torch

    cfg = json.loads((model_dir / "config.json").read_text())
    return layer_specs_from_config(cfg, model_dtype=torch.float32)


def _small_pool(model_dir: Path, requests: int = 1) -> int:
    """Bytes of a pool holding ``requests`` requests of MAX_MODEL_LEN (prefix caching on)."""
    specs = _specs(model_dir)
    probe = plan_pagefold(specs, 16, 1 << 30)
    per_req = max(pages_for_request(probe, MAX_MODEL_LEN, enable_prefix_caching=True),
                  KVCacheManager(replace(probe, num_blocks=2)).min_blocks_for(MAX_MODEL_LEN))
    return (requests * per_req + 1) * probe.layers_per_group * probe.page_bytes


def _llm(model_dir: Path, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 4 << 20)
    kw.setdefault("warm_up", False)  # a max_num_batched_tokens forward per engine: not tested here
    return LLM(str(model_dir), max_model_len=MAX_MODEL_LEN, **kw)


_FORCED = 2


def _forced_preemptions(llm: LLM, prompts) -> list[list[int]]:
    """Generate greedily, preempting the last two running requests mid-decode (the pool's
    own preemption mode: recompute or swap), then drain."""
    ids = [llm.add_request(p, GREEDY) for p in _inputs(prompts)]
    final: dict[str, object] = {}
    forced, sched = 0, llm.engine.scheduler
    while len(final) < len(ids):
        final.update({o.request_id: o for o in llm.step() if o.finished})
        decoding = [r for r in sched.running if r.num_computed_tokens > r.num_prompt_tokens]
        if forced < _FORCED and decoding:
            sched._preempt(decoding[-1])
            forced += 1
    assert forced == _FORCED
    return [list(final[i].outputs[0].token_ids) for i in ids]


def run_scenario(model_dir: Path, scenario: str, random_prompts) -> None:
    """One scenario of the module docstring on ``model_dir``; asserts exactness and a whole
    pool."""
    prompts = random_prompts(6, 5, MAX_LEN, VOCAB, seed=17)
    if scenario in ("batch", "chunk7"):
        ref = hf_greedy(model_dir, prompts, N_NEW)
        kw = {"max_num_batched_tokens": 7} if scenario == "chunk7" else {}
        llm = _llm(model_dir, **kw)
        assert _tokens(llm.generate(_inputs(prompts), GREEDY, use_tqdm=False)) == ref
        llm.engine.kv.check_whole()
    elif scenario == "preempt":
        ref = hf_greedy(model_dir, prompts, N_NEW)
        grows = any(is_attention(s) for s in _specs(model_dir).values())
        for mode in ("recompute", "swap"):
            llm = _llm(model_dir, kv_cache_memory=_small_pool(model_dir),
                       max_num_batched_tokens=33, preemption_mode=mode, swap_space="4MiB")
            got = _forced_preemptions(llm, prompts)
            assert got == ref, mode
            kinds = llm.engine.scheduler.preemptions_by_kind
            # Fixed-size states never outgrow the pool; attention pages do, so a model with
            # attention also preempts on its own (beyond the forced ones).
            assert kinds.get(mode, 0) > (_FORCED if grows else _FORCED - 1), (mode, kinds)
            llm.engine.kv.check_whole()
    elif scenario == "prefix":
        shared = random_prompts(1, 40, 40, VOCAB, seed=23)[0]
        tails = random_prompts(3, 3, 15, VOCAB, seed=29)
        ps = [shared + t for t in tails]
        ref = hf_greedy(model_dir, ps, N_NEW)
        llm = _llm(model_dir, state_checkpoint_interval=16, max_num_batched_tokens=19)
        first = _tokens(llm.generate(_inputs(ps[:1]), GREEDY, use_tqdm=False))
        before = llm.engine.kv.stats.hits
        rest = _tokens(llm.generate(_inputs(ps[1:]), GREEDY, use_tqdm=False))
        assert first + rest == ref
        assert llm.engine.kv.stats.hits - before >= 32 * len(ps[1:])
        llm.engine.kv.check_whole()
    else:
        ps = prompts[:3]
        ref = hf_greedy(model_dir, ps, N_NEW)
        llm = _llm(model_dir)
        params = SamplingParams(n=2, temperature=0, max_tokens=N_NEW, ignore_eos=True)
        outs = llm.generate(_inputs(ps), params, use_tqdm=False)
        for o, r in zip(outs, ref, strict=True):
            assert [list(c.token_ids) for c in o.outputs] == [r, r]
        assert llm.engine.scheduler.num_forks >= len(ps)
        llm.engine.kv.check_whole()


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers(arch: str, scenario: str, tiny_model_factory,
                              random_prompts) -> None:
    run_scenario(tiny_model_factory(arch), scenario, random_prompts)


@pytest.mark.parametrize("arch", ARCHS)
def test_capacity_matches_engine(arch: str, tiny_model_factory, capsys) -> None:
    """``pagefold capacity`` on config.json alone = the pool the engine builds from the loaded
    transformers config: same groups and specs, page, usable blocks, blocks per request."""
    model_dir = tiny_model_factory(arch)
    memory = 1 << 20
    args = ["capacity", str(model_dir), "--kv-cache-memory", str(memory), "--max-model-len",
            str(MAX_MODEL_LEN), "--enable-prefix-caching", "--json"]
    assert capacity_main(args) == 0
    report = json.loads(capsys.readouterr().out)
    llm = _llm(model_dir, kv_cache_memory=memory)
    cfg = llm.engine.kv_config
    assert cfg.groups == plan_pagefold(_specs(model_dir), 16, memory).groups
    assert llm.engine.kv.pool.num_usable == report["usable_blocks"]
    assert cfg.page_bytes == report["page_size_bytes"]
    assert report["blocks_per_request"] == pages_for_request(cfg, MAX_MODEL_LEN,
                                                             enable_prefix_caching=True)
    assert capacity_main([*args, "--layout", "vllm"]) == 0
    assert json.loads(capsys.readouterr().out)["usable_blocks"] > 0


def test_vllm_layout_by_hand(tiny_model_factory, capsys) -> None:
    """``--layout vllm`` numbers derived by hand (float32) for a state-only model and for the
    latent-attention hybrid. Mamba-2: the page is one unpadded state, conv (128, 2) + ssm
    (10, 8, 12) = (256 + 960) * 4 bytes; 3 layers in one group; 2 blocks per request with
    prefix caching. Kimi Linear: an MLA token row is 24 + 8 values (128 bytes), the KDA state
    conv (90, 2) + ssm (3, 10, 10) = 720 + 1200 bytes fits a 16-token page (2048 bytes)."""
    memory = 1 << 20

    def report(arch: str) -> dict:
        args = ["capacity", str(tiny_model_factory(arch)), "--kv-cache-memory", str(memory),
                "--max-model-len", str(MAX_MODEL_LEN), "--enable-prefix-caching", "--json",
                "--layout", "vllm"]
        assert capacity_main(args) == 0
        return json.loads(capsys.readouterr().out)

    m = report("mamba2")
    assert m["page_size_bytes"] == (256 + 960) * 4
    assert m["usable_blocks"] == memory // (3 * 4864)
    assert m["blocks_per_request"] == 2
    k = report("kimi_linear")
    assert k["page_size_bytes"] == 16 * 128 == 2048
    # groups: 3 KDA layers, 1 MLA layer -> groups of 1 layer; 4 groups share the pool
    assert k["usable_blocks"] == memory // 2048
    assert k["blocks_per_request"] == 3 * 2 + -(-MAX_MODEL_LEN // 16)


def test_llama4_chunked_groups_by_hand(tiny_model_factory) -> None:
    """Llama-4's chunked layers (chunk 13) at 19 tokens per step and max_model_len 72, 16-token
    blocks. vLLM holds ``chunk + max_num_batched_tokens`` tokens: cdiv(32, 16) = 2 blocks.
    pagefold's peak: keys from the first query's chunk start (at most 12 tokens back) through a
    19-token step span 31 tokens, overlapping up to cdiv(30, 16) + 1 = 3 blocks; full layers
    take cdiv(72, 16) = 5 either way."""
    specs = _specs(tiny_model_factory("llama4"))
    vllm = plan_vllm(specs, memory_bytes=1 << 20, max_model_len=MAX_MODEL_LEN,
                     enable_prefix_caching=True, max_num_batched_tokens=19)
    assert sorted((g.kind, g.blocks_per_request) for g in vllm.groups) == [
        ("chunked_local", 2), ("chunked_local", 2), ("full_attention", 5)]
    cfg = plan_pagefold(specs, 16, 1 << 20)
    per_group = sorted((g.spec.manager_kind, group_pages_for_request(
        g, 16, MAX_MODEL_LEN, enable_prefix_caching=True, max_num_batched_tokens=19))
        for g in cfg.groups)
    assert per_group == [("chunked_local", 3), ("chunked_local", 3), ("full_attention", 5)]
