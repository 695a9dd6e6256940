"""Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``) end to end against transformers, one rank.

Greedy float32 tokens of 12 prompts of 5..48 tokens run together must equal
``transformers``' ``generate``: in an ample pool, under chunked prefill at 7 tokens per step,
and under chunked prefill at 33 tokens in a pool so small that requests are preempted and
recomputed, each run twice (outside the tiny pool the second pass hits the prefix cache).
The multimodal wrapper's layout (``Qwen3_5MoeForConditionalGeneration``: text weights under
``model.language_model.``, experts stacked as transformers keeps them in memory, a vision
tower and an MTP head to skip) gives the same tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagefold import LLM, SamplingParams
from pagefold.testing.oracle import hf_greedy
from pagefold.testing.tiny_models import random_prompts

N_PROMPTS, MIN_LEN, MAX_LEN, N_NEW, VOCAB = 12, 5, 48, 8, 512
MAX_MODEL_LEN = 64
GREEDY = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
SCENARIOS = {
    "ample": dict(kv_cache_memory=4 << 20),
    "chunk7": dict(kv_cache_memory=4 << 20, max_num_batched_tokens=7),
    "chunk33_preempt": dict(kv_cache_memory=24 * 8192, max_num_batched_tokens=33),
}


@pytest.fixture(scope="module")
def moe_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("qwen3_5_moe")


@pytest.fixture(scope="module")
def prompts_and_ref(moe_dir):
    prompts = random_prompts(N_PROMPTS, MIN_LEN, MAX_LEN, VOCAB, seed=7)
    return prompts, hf_greedy(moe_dir, prompts, N_NEW)


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_qwen3_5_moe_matches_hf(moe_dir, prompts_and_ref, scenario: str) -> None:
    prompts, ref = prompts_and_ref
    llm = LLM(str(moe_dir), max_model_len=MAX_MODEL_LEN, **SCENARIOS[scenario])
    assert type(llm.engine.model).__name__ == "Qwen3_5MoeForCausalLM"
    for _ in range(2):
        assert _tokens(llm, prompts) == ref
        llm.engine.kv.check_whole()
    if "preempt" in scenario:  # the tiny pool evicts what the second pass would hit
        assert llm.engine.scheduler.num_preemptions > 0
    else:
        assert llm.engine.kv.stats.hits > 0


def test_multimodal_layout_with_stacked_experts(moe_dir, prompts_and_ref, tmp_path) -> None:
    mm = tmp_path / "qwen3_5_moe_mm"
    mm.mkdir()
    for f in moe_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, mm / f.name)
    text_cfg = json.loads((moe_dir / "config.json").read_text())
    text_cfg.pop("architectures")
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
              "text_config": text_cfg,
              "vision_config": {"depth": 1, "hidden_size": 32, "num_heads": 2,
                                "intermediate_size": 64, "out_hidden_size": 64}}
    (mm / "config.json").write_text(json.dumps(config))
    weights = load_file(str(moe_dir / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    n = text_cfg["num_experts"]
    for i in range(text_cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts"
        gate = [weights.pop(f"{p}.{e}.gate_proj.weight") for e in range(n)]
        up = [weights.pop(f"{p}.{e}.up_proj.weight") for e in range(n)]
        down = [weights.pop(f"{p}.{e}.down_proj.weight") for e in range(n)]
        out[f"{p}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        out[f"{p}.down_proj"] = torch.stack(down)
    out.update(weights)
    renamed = {("model.language_model." + k.removeprefix("model.") if k.startswith("model.")
                else k): v for k, v in out.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(32, 3, 2, 16, 16)
    renamed["mtp.fc.weight"] = torch.zeros(64, 128)
    save_file(renamed, str(mm / "model.safetensors"))

    prompts, ref = prompts_and_ref
    llm = LLM(str(mm), max_model_len=MAX_MODEL_LEN, kv_cache_memory=1 << 21)
    assert type(llm.engine.model).__name__ == "Qwen3_5MoeForConditionalGeneration"
    assert _tokens(llm, prompts[:6]) == ref[:6]
    llm.engine.kv.check_whole()
