"""Gated DeltaNet hybrids end to end against transformers: Qwen3.5 (text and multimodal layout)
and Qwen3-Next (MoE).

Every scenario runs 16 prompts of 5..48 tokens together, greedy, float32, and compares the
tokens with ``hf_greedy`` and the chosen tokens' logprobs with a teacher-forced
``hf_logprobs`` pass. Scenarios: an ample pool; chunked prefill at 7 tokens per step (prefill
chunks mixed with decodes, states handed across chunks); chunked prefill at 33 tokens in a
pool so small that requests are preempted and recomputed. Qwen3-Next's router can flip on a
near tie between two float32 implementations, so there the comparison stops at the first
divergence after checking that each side's token is in the other's top 5.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagefold import LLM, SamplingParams
from pagefold.testing.oracle import hf_greedy, hf_logprobs, load_hf_model

N_PROMPTS, MIN_LEN, MAX_LEN, N_NEW, VOCAB = 16, 5, 48, 10, 512
MAX_MODEL_LEN = 64  # > MAX_LEN + N_NEW; the small pool must still hold one such request
TOP = 5
LOGPROB_ATOL = 1e-4

# Engine settings per scenario. kv_cache_memory in bytes; one page is 8 KiB for these configs,
# so 20 pages hold ~4 of the 16 requests (3 GDN state pages + 1-4 attention pages each) and
# preemption is certain. That run also chunks prefills at 33 tokens, mixed with decodes.
SCENARIOS = {
    "ample": dict(kv_cache_memory=4 << 20),
    "chunk7": dict(kv_cache_memory=4 << 20, max_num_batched_tokens=7),
    "chunk33_preempt": dict(kv_cache_memory=20 * 8192, max_num_batched_tokens=33),
}

def _prompts(random_prompts) -> list[list[int]]:
    return random_prompts(N_PROMPTS, MIN_LEN, MAX_LEN, VOCAB, seed=7)


def _generate(model_dir: Path, prompts: list[list[int]], **engine_kw):
    llm = LLM(str(model_dir), max_model_len=MAX_MODEL_LEN, **engine_kw)
    params = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs], llm


def _check_logprobs(model_dir: Path, prompt: list[int], out, n: int) -> None:
    """The first ``n`` chosen tokens' logprobs (and the first step's top 5) match HF's."""
    if n == 0:
        return
    ref = hf_logprobs(model_dir, prompt + list(out.token_ids[: n - 1]), TOP)[len(prompt) - 1 :]
    for i in range(n):
        tok = out.token_ids[i]
        got = out.logprobs[i]
        assert tok in ref[i], f"step {i}: token {tok} not in HF's top {TOP}"
        assert got[tok].logprob == pytest.approx(ref[i][tok], abs=LOGPROB_ATOL), f"step {i}"
    first = out.logprobs[0]
    for tok, lp in ref[0].items():
        assert tok in first and first[tok].logprob == pytest.approx(lp, abs=LOGPROB_ATOL)


def _finish(llm: LLM, scenario: str) -> None:
    llm.engine.kv.check_whole()
    if "preempt" in scenario:
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_qwen3_5_matches_hf(qwen3_5_dir: Path, random_prompts, scenario: str) -> None:
    prompts = _prompts(random_prompts)
    ref = hf_greedy(qwen3_5_dir, prompts, N_NEW)
    outs, llm = _generate(qwen3_5_dir, prompts, **SCENARIOS[scenario])
    assert [list(o.token_ids) for o in outs] == ref
    for p, o in zip(prompts, outs):
        _check_logprobs(qwen3_5_dir, p, o, N_NEW)
    _finish(llm, scenario)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_qwen3_next_matches_hf(qwen3_next_dir: Path, random_prompts, scenario: str) -> None:
    prompts = _prompts(random_prompts)
    ref = hf_greedy(qwen3_next_dir, prompts, N_NEW)
    outs, llm = _generate(qwen3_next_dir, prompts, **SCENARIOS[scenario])
    exact = 0
    for p, o, r in zip(prompts, outs, ref):
        got = list(o.token_ids)
        d = next((i for i, (a, b) in enumerate(zip(got, r)) if a != b), None)
        if d is None:
            exact += 1
            _check_logprobs(qwen3_next_dir, p, o, N_NEW)
            continue
        # Near-tie routing flip: both tokens must be plausible to both implementations.
        hf_top = hf_logprobs(qwen3_next_dir, p + r[:d], TOP)[-1]
        assert got[d] in hf_top, f"pagefold token {got[d]} not in HF's top {TOP} at step {d}"
        assert r[d] in o.logprobs[d], f"HF token {r[d]} not in pagefold's top {TOP} at {d}"
        _check_logprobs(qwen3_next_dir, p, o, d)
    # A flip is rare; most sequences must agree exactly or the rule is hiding a real bug.
    assert exact >= N_PROMPTS - 2, f"only {exact}/{N_PROMPTS} sequences match exactly"
    _finish(llm, scenario)


def test_moe_block_matches_transformers(qwen3_next_dir: Path) -> None:
    """The sparse MoE block (router, top-k, renormalisation, gated shared expert) vs HF's."""
    from pagefold.layers.moe import SparseMoeBlock

    hf_block = load_hf_model(qwen3_next_dir).model.layers[0].mlp
    cfg = hf_block.gate
    block = SparseMoeBlock(64, cfg.num_experts, cfg.top_k, 32, norm_topk_prob=cfg.norm_topk_prob,
                           shared_inter=48)
    sd = hf_block.state_dict()
    sh = "shared_expert."
    sd[sh + "gate_up_proj.weight"] = torch.cat(
        [sd.pop(sh + "gate_proj.weight"), sd.pop(sh + "up_proj.weight")])
    block.load_state_dict(sd)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(block(x), hf_block(x[None])[0], atol=1e-6, rtol=1e-6)
        # Every slot routed to expert 0: the idle experts are skipped, duplicate rows add up.
        top_idx = torch.zeros(3, 2, dtype=torch.long)
        y = block.experts(x[:3], top_idx, torch.full((3, 2), 0.5))
        w_gu, w_d = block.experts.gate_up_proj[0], block.experts.down_proj[0]
        gate, up = (x[:3] @ w_gu.T).chunk(2, dim=-1)
        expect = (torch.nn.functional.silu(gate) * up) @ w_d.T
        torch.testing.assert_close(y, 0.5 * expect + 0.5 * expect)
        assert block.experts(x[:0], top_idx[:0], top_idx[:0].float()).shape == (0, 64)


def test_qwen3_5_multimodal_layout_loads(qwen3_5_dir: Path, random_prompts,
                                        tmp_path: Path) -> None:
    """A Qwen3_5ForConditionalGeneration directory (nested text_config, text weights under
    model.language_model., a vision tower and an MTP head to skip) gives the text model's
    tokens. Tying is stated only at the top level, as multimodal configs may do."""
    mm = tmp_path / "qwen3_5_mm"
    mm.mkdir()
    for f in qwen3_5_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, mm / f.name)
    text_cfg = json.loads((qwen3_5_dir / "config.json").read_text())
    tied = text_cfg.pop("tie_word_embeddings")
    assert tied, "the tiny Qwen3.5 is tied; this test exercises the tie fallback"
    text_cfg.pop("architectures")
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text_cfg,
        "vision_config": {"depth": 1, "hidden_size": 32, "num_heads": 2,
                          "intermediate_size": 64, "out_hidden_size": 64},
        "tie_word_embeddings": True,
    }
    (mm / "config.json").write_text(json.dumps(config))
    weights = load_file(str(qwen3_5_dir / "model.safetensors"))
    assert "lm_head.weight" not in weights
    renamed = {"model.language_model." + k.removeprefix("model."): v for k, v in weights.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(32, 3, 2, 16, 16)
    renamed["mtp.fc.weight"] = torch.zeros(64, 128)
    save_file(renamed, str(mm / "model.safetensors"))

    prompts = _prompts(random_prompts)[:6]
    llm = LLM(str(mm), max_model_len=MAX_MODEL_LEN, kv_cache_memory=1 << 20)
    assert type(llm.engine.model).__name__ == "Qwen3_5ForConditionalGeneration"
    params = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    text_ref = hf_greedy(qwen3_5_dir, _prompts(random_prompts), N_NEW)[:6]
    assert [list(o.outputs[0].token_ids) for o in outs] == text_ref
    llm.engine.kv.check_whole()
