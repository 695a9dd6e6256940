"""Decode steps over the static, padded batch that CUDA graphs replay, checked on the CPU.

``capture=False`` runs exactly the padded static step a graph would replay, eagerly, with the
Triton kernels under the interpreter: its tokens must equal transformers', and padding rows
must not write any page an eager run of the same schedule leaves untouched.
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
def test_padded_static_decode_matches_eager_and_transformers(tiny_model_factory,
                                                             random_prompts, triton_mode):
    # One GDN and one attention layer: the padding rows meet both kinds of cache.
    model = tiny_model_factory("qwen3_5", num_hidden_layers=2,
                               layer_types=["linear_attention", "full_attention"])
    prompts = random_prompts(3, 4, 8, 512, seed=31)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ref = hf_greedy(model, prompts, 3)
    runs = []
    for graphs in (False, True):
        # A small token budget: the engine's start-up warm-up forward is that many tokens,
        # and the interpreter's time grows with it.
        llm = LLM(str(model), max_model_len=32, kv_cache_memory=1 << 20,
                  max_num_batched_tokens=16)
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
            assert calls["n"] >= 2  # every decode step went through the bucket of 4
        runs.append([t.clone() for t in runner.cache.shared])
    # Padding rows wrote nothing: the same pages hold data (the pool starts zeroed; the bytes
    # themselves may differ in the last bits, the linears' sums depend on the row count).
    for eager, padded in zip(*runs):
        assert torch.equal(eager.ne(0).any(1), padded.ne(0).any(1))


def test_static_batch_fill_pads_inert_rows(qwen3_5_dir):
    """A 3-row decode step in a bucket of 8: real rows copied, the rest inert (slot -1, no
    keys, page -1, not fresh), cu_seqlens one token per row; a smaller step clears rows."""
    from pagefold.executor.cuda_graphs import StaticBatch
    from pagefold.executor.input_batch import build_inputs

    llm = LLM(str(qwen3_5_dir), max_model_len=64, kv_cache_memory=1 << 20)
    cfg = llm.engine.kv_config
    per_group = []
    for g in cfg.groups:
        per_group.append([[3 + i] * (g.pages_per_state or 2) for i in range(3)])
    inp = build_inputs(cfg, [[7], [8], [9]], [20, 5, 17], [1, 1, 1], [21, 6, 18], per_group)
    sb = StaticBatch(cfg, 8, 64, torch.device("cpu"))
    sb.fill(inp.input_ids, inp.positions, inp.attn_meta, inp.state_meta)
    assert sb.input_ids.tolist() == [7, 8, 9, 0, 0, 0, 0, 0]
    kinds = set()
    for g, am, sm in zip(sb.groups, inp.attn_meta, inp.state_meta):
        if g.attn is not None:
            kinds.add("attn")
            assert g.attn.slot_mapping[:3].tolist() == am.slot_mapping.tolist()
            assert g.attn.slot_mapping[3:].eq(-1).all()
            assert g.attn.decode_seq_lens.tolist() == [21, 6, 18, 0, 0, 0, 0, 0]
            assert g.attn.decode_tables[:3, :2].tolist() == am.decode_tables.tolist()
        else:
            kinds.add("state")
            assert g.state.page_ids[:3].tolist() == sm.page_ids.tolist()
            assert g.state.page_ids[3:].eq(-1).all()
            assert g.state.has_initial_state.tolist() == [True] * 3 + [False] * 5
            assert g.state.cu_seqlens.tolist() == list(range(9))
    assert kinds == {"attn", "state"}
    one = build_inputs(cfg, [[4]], [9], [1], [10], [p[:1] for p in per_group])
    sb.fill(one.input_ids, one.positions, one.attn_meta, one.state_meta)
    for g in sb.groups:
        if g.attn is not None:
            assert g.attn.slot_mapping[1:].eq(-1).all() and g.attn.decode_seq_lens[1:].eq(0).all()
        else:
            assert g.state.page_ids[1:].eq(-1).all()
    with pytest.raises(ValueError, match="bucket"):
        StaticBatch(cfg, 2, 64, torch.device("cpu")).fill(
            inp.input_ids, inp.positions, inp.attn_meta, inp.state_meta)


def test_chunked_local_rows_start_at_their_chunk(tiny_model_factory):
    """Llama-4's chunked local groups (chunk 13): decode rows read keys from their own chunk
    start (positions 20, 5, 17 -> 13, 0, 13), in the eager metadata and in the static batch a
    graph replays; a prefill row starts at its first query's chunk (15 -> 13); full-attention
    groups read from 0."""
    import json

    from pagefold.core.kv_cache_planner import plan_pagefold
    from pagefold.core.kv_cache_spec import ChunkedLocalAttentionSpec
    from pagefold.core.spec_from_config import layer_specs_from_config
    from pagefold.executor.cuda_graphs import StaticBatch
    from pagefold.executor.input_batch import build_inputs

    model = tiny_model_factory("llama4")
    specs = layer_specs_from_config(json.loads((model / "config.json").read_text()),
                                    model_dtype=torch.float32)
    cfg = plan_pagefold(specs, 16, 1 << 20)
    chunked = [isinstance(g.spec, ChunkedLocalAttentionSpec) for g in cfg.groups]
    assert sorted(chunked) == [False, True, True]
    tables = [[[3 + i, 9 + i, 15 + i] for i in range(3)] for _ in cfg.groups]
    inp = build_inputs(cfg, [[7], [8], [9]], [20, 5, 17], [1, 1, 1], [21, 6, 18], tables)
    sb = StaticBatch(cfg, 8, 64, torch.device("cpu"))
    sb.fill(inp.input_ids, inp.positions, inp.attn_meta, inp.state_meta)
    for local, am, g in zip(chunked, inp.attn_meta, sb.groups, strict=True):
        if local:
            assert am.decode_kv_start.tolist() == [13, 0, 13]
            assert g.attn.decode_kv_start[:3].tolist() == [13, 0, 13]
        else:
            assert am.decode_kv_start is None and g.attn.decode_kv_start is None
    pre = build_inputs(cfg, [list(range(20))], [15], [20], [40], [t[:1] for t in tables])
    assert [am.prefills[0].kv_start for am in pre.attn_meta] == [13 if c else 0 for c in chunked]
