"""Checkpoint loading: sharded safetensors, missing shards, tied/untied embeddings, dtypes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pagefold import LLM, SamplingParams
from pagefold.testing.oracle import hf_greedy

PROMPTS = [[17, 230, 99, 41, 5, 300], list(range(40, 77)), [450, 12, 19]]
NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def _tokens(model_dir: Path, **kw) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(model_dir), max_model_len=64, kv_cache_memory=1 << 20, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    llm.engine.kv.check_whole()
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def sharded_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama", max_shard_size="20KB")


def test_sharded_checkpoint_matches_unsharded(sharded_dir: Path, llama_dir: Path):
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and not (sharded_dir / "model.safetensors").exists()
    _, sharded = _tokens(sharded_dir)
    _, single = _tokens(llama_dir)
    assert sharded == single == hf_greedy(llama_dir, PROMPTS, NEW)


def test_missing_shard_is_a_clear_error(sharded_dir: Path, tmp_path: Path):
    broken = tmp_path / "broken"
    shutil.copytree(sharded_dir, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (broken / victim).unlink()
    with pytest.raises((FileNotFoundError, ValueError), match="missing") as e:
        LLM(str(broken), max_model_len=64, kv_cache_memory=1 << 20)
    assert victim in str(e.value)


def test_checkpoint_lacking_a_weight_is_refused(llama_dir: Path, tmp_path: Path):
    from safetensors.torch import load_file, save_file

    partial = tmp_path / "partial"
    shutil.copytree(llama_dir, partial)
    weights = load_file(str(partial / "model.safetensors"))
    dropped = "model.layers.1.mlp.down_proj.weight"
    del weights[dropped]
    save_file(weights, str(partial / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj"):
        LLM(str(partial), max_model_len=64, kv_cache_memory=1 << 20)


@pytest.mark.parametrize(
    "arch,tied",
    [("llama", True), ("llama", False), ("qwen3", True)],
)
def test_tied_and_untied_embeddings(tiny_model_factory, arch: str, tied: bool):
    default_tied = arch == "llama"
    # Only override when needed, so the default directories are shared with other tests.
    kw = {} if tied == default_tied else {"tie_word_embeddings": tied}
    model_dir = tiny_model_factory(arch, **kw)
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg.get("tie_word_embeddings", False) == tied
    llm, toks = _tokens(model_dir)
    model = llm.engine.model
    shares = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert shares == tied
    assert toks == hf_greedy(model_dir, PROMPTS, NEW)


@pytest.fixture(scope="module")
def bf16_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("qwen2", dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "which,dtype,expect",
    [
        ("f32", "auto", torch.float32),
        ("f32", "float32", torch.float32),
        ("f32", "bfloat16", torch.bfloat16),
        ("bf16", "auto", torch.bfloat16),
        ("bf16", "float32", torch.float32),
    ],
)
def test_dtype_choice(qwen2_dir: Path, bf16_dir: Path, which: str, dtype: str,
                      expect: torch.dtype):
    model_dir = bf16_dir if which == "bf16" else qwen2_dir
    llm, toks = _tokens(model_dir, dtype=dtype)
    assert llm.engine.dtype == expect
    assert {p.dtype for p in llm.engine.model.parameters()} == {expect}
    assert llm.engine.runner.cache.attn["layers.0"].dtype == expect  # kv cache "auto"
    assert all(len(t) == NEW for t in toks)
    if expect == torch.float32:
        # bf16 -> float32 is exact, so float32 runs match the float32 oracle either way.
        assert toks == hf_greedy(model_dir, PROMPTS, NEW)
