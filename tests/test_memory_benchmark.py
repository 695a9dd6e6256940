"""Smoke run of benchmarks/memory.py at small sizes: pagefold's internal fragmentation stays under
one page per group per request, analytically on real shapes and in a real engine's block tables,
and the reported numbers agree with a direct recomputation from the specs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagefold.core.kv_cache_spec import StateSpec, cdiv, is_attention
from pagefold.core.spec_from_config import layer_specs_from_config

REPO = str(Path(__file__).resolve().parents[1])  # benchmarks/ is a package beside pagefold/


@pytest.fixture
def memory(monkeypatch):
    monkeypatch.syspath_prepend(REPO)
    from benchmarks import memory

    return memory


def pagefold_waste(specs: dict, n: int, block_size: int = 16) -> int:
    """Bytes one request of ``n`` tokens wastes in pagefold's layout, from first principles
    (assumes no empty layer slots, true for the shapes used here)."""
    page = next(s.page_bytes(block_size) for s in specs.values() if is_attention(s))
    waste = 0
    for s in specs.values():
        if isinstance(s, StateSpec):
            waste += cdiv(s.state_bytes, page) * page - s.unpadded_bytes
        else:
            waste += (cdiv(n, block_size) * block_size - n) * s.bytes_per_token
    return waste


def test_memory_benchmark_small(memory, qwen3_5_dir, capsys):
    res = memory.main([
        "--num-requests", "24", "--min-len", "32", "--max-len", "4096", "--seed", "3",
        "--model", str(qwen3_5_dir), "--engine-requests", "6", "--engine-max-len", "80",
        "--decode-room", "64", "--max-num-batched-tokens", "64",
    ])  # fmt: skip
    out = capsys.readouterr().out
    lengths = memory.draw_lengths(24, 32, 4096, 3)

    # --- analytic: both built-in shapes
    qwen, nemo = res["analytic"]
    assert qwen["vllm_block_tokens"] == 1568 and nemo["vllm_block_tokens"] == 1040
    assert qwen["pf_pages_per_state"] == 98 and nemo["pf_pages_per_state"] == 65
    for r, setup in zip((qwen, nemo), memory.BUILTIN):
        pf, vl = r["layouts"]["pagefold"], r["layouts"]["vllm"]
        assert pf["max waste pages/group"] < 1
        assert all(g["max waste pages"] < 1 for g in pf["groups"])
        assert pf["mean need B"] == vl["mean need B"]  # same requests, same bytes needed
        assert 0 <= pf["mean waste B"] < vl["mean waste B"]
        assert pf["fit"] >= vl["fit"] and pf["fit"] <= pf["ideal fit"]
        # vLLM's attention block wastes up to (block - 1) tokens: many 16-token pages.
        assert vl["max waste small pages/group"] > 16
        specs = memory.specs_for(setup.config, setup.tp, setup.kv_cache_dtype)
        expect = [pagefold_waste(specs, n) for n in lengths]
        assert pf["max waste B"] == max(expect)
        assert pf["mean waste B"] == pytest.approx(sum(expect) / len(expect))
        assert setup.name in out

    # --- measured: the engine's block tables
    m = res["measured"]
    assert m["planner matches tables"] is True
    assert m["pool blocks in use"] == m["blocks in tables"] > 0
    tokens = m["computed tokens"]
    assert len(tokens) == 6 and all(t >= p for t, p in zip(tokens, m["prompt lengths"]))
    pf, vl = m["layouts"]["pagefold (measured)"], m["layouts"]["vllm (same requests)"]
    assert pf["max waste pages/group"] < 1
    assert all(g["max waste pages"] < 1 for g in pf["groups"])
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(qwen3_5_dir)
    specs = layer_specs_from_config(hf, model_dtype=torch.bfloat16)  # the benchmark's --dtype
    expect = [pagefold_waste(specs, n) for n in tokens]
    assert pf["max waste B"] == max(expect)
    assert pf["mean waste B"] == pytest.approx(sum(expect) / len(expect))
    assert vl["mean alloc B"] >= vl["mean need B"] == pf["mean need B"]
    assert "measured: tiny engine" in out and "vllm (same requests)" in out
