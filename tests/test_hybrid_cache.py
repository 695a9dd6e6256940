"""The shared pool's layout contract, sliding windows, FP8 pages, and state-page lifetimes."""

from __future__ import annotations

import pytest
import torch

from pagefold import LLM, SamplingParams
from pagefold.core.kv_cache_planner import plan_pagefold
from pagefold.core.kv_cache_spec import FullAttentionSpec, StateComponent, StateSpec
from pagefold.executor.cache_tensors import CacheTensors
from pagefold.ops.attention import read_kv, write_kv
from pagefold.testing.oracle import hf_greedy

GDN = StateSpec("gdn", (StateComponent("conv", (40, 3), torch.bfloat16),
                        StateComponent("ssm", (4, 16, 24), torch.float32)))


def _hybrid_config(kv_dtype=torch.float32, blocks=60):
    specs = {"layers.0": GDN, "layers.1": GDN, "layers.2": GDN,
             "layers.3": FullAttentionSpec(2, 16, kv_dtype)}
    page = FullAttentionSpec(2, 16, kv_dtype).page_bytes(16)
    return plan_pagefold(specs, 16, blocks * page)


def test_groups_never_write_into_each_others_pages():
    """Fill the pool with a sentinel, write through one group's views into the blocks that
    group owns, and check that every other byte of every shared tensor is unchanged."""
    for kv_dtype in (torch.float32, torch.float8_e4m3fn):
        cfg = _hybrid_config(kv_dtype)
        assert len(cfg.groups) == 4 and cfg.layers_per_group == 1
        state_groups = [g for g in cfg.groups if isinstance(g.spec, StateSpec)]
        assert state_groups[0].pages_per_state > 1  # the state spans several small pages
        cache = CacheTensors(cfg, torch.device("cpu"))
        for t in cache.shared:
            t.fill_(0xA5)
        before = [t.clone() for t in cache.shared]
        n_pages = state_groups[0].pages_per_state
        owned = {"layers.3": [5, 9], "layers.0": list(range(12, 12 + n_pages))}
        # Attention group: write K/V of 20 tokens into blocks 5 and 9.
        slots = torch.cat([torch.arange(5 * 16, 6 * 16), torch.arange(9 * 16, 9 * 16 + 4)])
        k, v = torch.randn(20, 2, 16), torch.randn(20, 2, 16)
        write_kv(cache.attn["layers.3"], slots, k, v)
        kv = read_kv(cache.attn["layers.3"], slots, torch.float32)
        tol = 0.0 if kv_dtype == torch.float32 else 0.13
        assert torch.allclose(kv[:, 0], k, atol=tol, rtol=tol)
        assert torch.allclose(kv[:, 1], v, atol=tol, rtol=tol)
        # State group: scatter one state over its pages.
        view = cache.state["layers.0"]
        pages = torch.tensor([owned["layers.0"]])
        state = {"conv": torch.randn(1, 40, 3), "ssm": torch.randn(1, 4, 16, 24)}
        view.scatter(pages, state)
        back = view.gather(pages)
        assert torch.equal(back["ssm"], state["ssm"])
        assert torch.equal(back["conv"], state["conv"].to(torch.bfloat16))
        # Every byte of the state's pages is written: components, and zeros between and after
        # them (the 0xA5 fill must not survive anywhere, so pages are deterministic).
        want = torch.zeros(n_pages * view.page_bytes, dtype=torch.uint8)
        for comp, off in zip(view.spec.components, view.spec.offsets):
            src = state[comp.name].to(comp.dtype).reshape(-1).view(torch.uint8)
            want[off : off + comp.nbytes] = src
        assert view.gaps  # this layout has padding to zero
        assert torch.equal(view.raw[owned["layers.0"]].reshape(-1), want)
        touched = set(owned["layers.3"]) | set(owned["layers.0"])
        for t, b in zip(cache.shared, before):
            for row in range(cfg.num_blocks):
                if row not in touched:
                    assert torch.equal(t[row], b[row]), f"block {row} changed ({kv_dtype})"


def test_sliding_window_layers_exact_and_release_blocks(tiny_model_factory, random_prompts):
    model = tiny_model_factory(
        "qwen3", layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=24, use_sliding_window=True, max_window_layers=0)
    prompts = random_prompts(10, 5, 90, 512, seed=1)
    ref = hf_greedy(model, prompts, 16)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for kw in ({}, {"max_num_batched_tokens": 7}):
        llm = LLM(str(model), **kw)
        kinds = [g.spec.manager_kind for g in llm.engine.kv_config.groups]
        assert kinds.count("full_attention") == 1 and len(kinds) == 3
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
        llm.engine.kv.check_whole()
    # A long sequence holds only the window's blocks in a sliding group.
    llm = LLM(str(model), enable_prefix_caching=False)
    llm.add_request({"prompt_token_ids": list(range(5, 205))}, greedy)
    for _ in range(3):
        llm.step()
    swa = next(m for m in llm.engine.kv.managers if m.group.spec.manager_kind != "state"
               and hasattr(m.group.spec, "window"))
    held = [b for b in swa.req_blocks["0"] if b is not llm.engine.kv.pool.null_block]
    assert len(held) <= 24 // 16 + 2 < len(swa.req_blocks["0"])
    llm.abort(["0"])
    llm.engine.kv.check_whole()


def test_finished_request_returns_state_pages_on_that_step(qwen3_5_dir):
    llm = LLM(str(qwen3_5_dir), enable_prefix_caching=False)
    pool = llm.engine.kv.pool
    llm.add_request({"prompt_token_ids": list(range(5, 40))},
                    SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    llm.step()
    assert pool.num_free < pool.num_usable  # attention blocks and state pages held
    outs = llm.step()
    assert outs[0].finished
    assert pool.num_free == pool.num_usable  # everything back on the finishing step
    llm.engine.kv.check_whole()


def test_state_that_cannot_be_split_into_pages_is_a_clear_error():
    specs = {"layers.0": GDN, "layers.1": FullAttentionSpec(1, 4, torch.float8_e4m3fn)}
    with pytest.raises(ValueError, match="cannot be split into pages.*block_size"):
        plan_pagefold(specs, 1, 1 << 20)  # an 8-byte page cannot hold float32 state rows
    assert plan_pagefold(specs, 16, 1 << 20).groups[0].pages_per_state > 1  # 16 tokens can
