"""Tests for the tiny-model builders and the transformers oracle."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pagefold.testing import oracle, tiny_models
from pagefold.testing.tiny_models import (
    ARCHS,
    BOS_ID,
    EOS_ID,
    IM_END_ID,
    IM_START_ID,
    NUM_SPECIAL_TOKENS,
    PAD_ID,
)

VOCAB = 512


def _load_state(model_dir: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(path)))
    return state


def test_tokenizer_round_trips_non_ascii_and_chat_template(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tiny_models.build_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == VOCAB
    text = "héllo wörld ✓ 你好"
    ids = tok.encode(text, add_special_tokens=False)
    assert all(NUM_SPECIAL_TOKENS <= i < VOCAB for i in ids)
    assert tok.decode(ids) == text
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [IM_START_ID, IM_END_ID]

    messages = [{"role": "user", "content": "hi ✓"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi ✓<|im_end|>\n<|im_start|>assistant\n"
    no_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt == "<|im_start|>user\nhi ✓<|im_end|>\n"
    chat_ids = tok.encode(rendered, add_special_tokens=False)
    # Special tokens are single ids, never split into bytes.
    assert chat_ids[0] == IM_START_ID and chat_ids.count(IM_END_ID) == 1
    assert tok.decode(chat_ids) == rendered


def test_tokenizer_training_is_deterministic() -> None:
    cached = tiny_models._trained_tokenizer_json(VOCAB)
    # __wrapped__ bypasses the in-process cache and trains from scratch.
    assert tiny_models._trained_tokenizer_json.__wrapped__(VOCAB) == cached


@pytest.mark.parametrize("arch", ARCHS)
def test_arch_builds_loads_and_generates(tiny_model_factory, random_prompts, arch: str) -> None:
    model_dir = tiny_model_factory(arch)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["vocab_size"] == VOCAB
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        BOS_ID,
        EOS_ID,
        PAD_ID,
    )
    gen_config = json.loads((model_dir / "generation_config.json").read_text())
    assert gen_config["eos_token_id"] == [EOS_ID, IM_END_ID]
    assert (model_dir / "tokenizer.json").is_file()

    model = oracle.load_hf_model(model_dir)
    assert model.dtype == torch.float32
    text_config = model.config
    layer_types = list(getattr(text_config, "layer_types", None) or [])
    if arch in ("qwen3_5", "qwen3_next", "nemotron_h", "granitemoehybrid", "bamba"):
        assert "full_attention" in layer_types and "linear_attention" in layer_types

    prompts = random_prompts(2, 3, 20, VOCAB, seed=7)
    outs = oracle.hf_greedy(model_dir, prompts, max_new_tokens=5)
    assert [len(o) for o in outs] == [5, 5]
    assert all(0 <= t < VOCAB for o in outs for t in o)
    # The oracle's two entry points agree: greedy's first token is the argmax of the
    # teacher-forced distribution at the last prompt position.
    for prompt, out in zip(prompts, outs, strict=True):
        last = oracle.hf_logprobs(model_dir, prompt, top_k=3)[-1]
        assert max(last, key=last.__getitem__) == out[0]
        assert all(v <= 0.0 for v in last.values())


def test_hf_logprobs_matches_full_softmax(qwen3_5_dir: Path) -> None:
    ids = tiny_models.random_prompts(1, 12, 12, VOCAB, seed=3)[0]
    rows = oracle.hf_logprobs(qwen3_5_dir, ids, top_k=4)
    assert len(rows) == len(ids) and all(len(r) == 4 for r in rows)
    model = oracle.load_hf_model(qwen3_5_dir)
    with torch.no_grad():
        full = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for pos, row in enumerate(rows):
        top = full[pos].topk(4)
        assert list(row) == top.indices.tolist()
        assert torch.allclose(torch.tensor(list(row.values())), top.values, atol=1e-6)


def test_ignore_eos_neither_stops_nor_suppresses(
    qwen2_dir: Path, tmp_path: Path, random_prompts
) -> None:
    prompt = random_prompts(1, 8, 8, VOCAB, seed=11)[0]
    free = oracle.hf_greedy(qwen2_dir, [prompt], max_new_tokens=6)[0]
    # Make the token generated at step 3 an eos of a copy of the model.
    stop_id = free[3]
    copy_dir = tmp_path / "eos-copy"
    shutil.copytree(qwen2_dir, copy_dir)
    gen_path = copy_dir / "generation_config.json"
    gen_config = json.loads(gen_path.read_text())
    gen_config["eos_token_id"] = [stop_id]
    gen_path.write_text(json.dumps(gen_config))

    assert oracle.hf_greedy(copy_dir, [prompt], max_new_tokens=6, ignore_eos=True)[0] == free
    stopped = oracle.hf_greedy(copy_dir, [prompt], max_new_tokens=6, ignore_eos=False)[0]
    assert stopped == free[: free.index(stop_id) + 1]


def test_sharded_save_writes_index_and_matches_unsharded(
    tiny_model_factory, qwen3_dir: Path
) -> None:
    sharded = tiny_model_factory("qwen3", max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((sharded / s).is_file() for s in shards)
    assert not (sharded / "model.safetensors").exists()
    whole, split = _load_state(qwen3_dir), _load_state(sharded)
    assert whole.keys() == split.keys() == set(index["weight_map"])
    assert all(torch.equal(whole[k], split[k]) for k in whole)
    ids = [7, 99, 300, 42]
    assert oracle.hf_logprobs(sharded, ids, 2) == oracle.hf_logprobs(qwen3_dir, ids, 2)


def test_build_is_deterministic_in_seed(tmp_path: Path, qwen2_dir: Path) -> None:
    again = tiny_models.build_tiny_model("qwen2", tmp_path / "again")
    other = tiny_models.build_tiny_model("qwen2", tmp_path / "other", seed=1)
    ref, same, diff = _load_state(qwen2_dir), _load_state(again), _load_state(other)
    assert all(torch.equal(ref[k], same[k]) for k in ref)
    assert not torch.equal(ref["model.embed_tokens.weight"], diff["model.embed_tokens.weight"])


def test_tied_and_untied_embeddings(llama_dir: Path, qwen3_dir: Path) -> None:
    assert "lm_head.weight" not in tiny_models.describe(llama_dir)
    assert tiny_models.describe(qwen3_dir)["lm_head.weight"] == (VOCAB, 64)


def test_layer_count_override_rederives_pattern() -> None:
    kwargs = tiny_models.arch_config_kwargs("qwen3_5", num_hidden_layers=8)
    assert "layer_types" not in kwargs
    from transformers import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(**kwargs)
    assert cfg.layer_types.count("full_attention") == 2 and len(cfg.layer_types) == 8
    with pytest.raises(ValueError):
        tiny_models.arch_config_kwargs("gpt2")


def test_random_prompts_ranges_and_determinism() -> None:
    prompts = tiny_models.random_prompts(20, 2, 9, VOCAB, seed=5)
    assert len(prompts) == 20
    assert all(2 <= len(p) <= 9 for p in prompts)
    assert all(NUM_SPECIAL_TOKENS <= t < VOCAB for p in prompts for t in p)
    assert prompts == tiny_models.random_prompts(20, 2, 9, VOCAB, seed=5)
    assert prompts != tiny_models.random_prompts(20, 2, 9, VOCAB, seed=6)
    with pytest.raises(ValueError):
        tiny_models.random_prompts(1, 5, 4, VOCAB)


def test_build_demo_model_once(tmp_path: Path) -> None:
    path = tiny_models.build_demo_model(tmp_path)
    assert path == tmp_path / "demo-qwen3"
    config = json.loads((path / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (256, 4)
    assert config["model_type"] == "qwen3"
    weights = path / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert tiny_models.build_demo_model(tmp_path) == path
    assert weights.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == ["demo-qwen3"]
