"""Llama-4 checkpoints as published (``Llama4ForConditionalGeneration``) served text only,
against transformers' own ``Llama4ForConditionalGeneration`` (float32, greedy).

The tiny checkpoint (``pagefold.testing.tiny_vl_models.build_tiny_llama4_vl``) keeps the text
model under ``language_model.*`` next to a vision tower and projector, which pagefold skips;
image inputs are refused. Scenarios: a batch of 3 prompts, chunked prefill at 7 tokens, and a
prefix hit; each leaves the pool whole.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pagefold import LLM, SamplingParams
from pagefold.testing.tiny_vl_models import build_tiny_llama4_vl

N_NEW, VOCAB = 6, 512
GREEDY = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def l4_dir(tmp_path_factory) -> Path:
    return build_tiny_llama4_vl(tmp_path_factory.mktemp("llama4_vl"))


@pytest.fixture(scope="module")
def reference(l4_dir):
    """prompt ids -> transformers' greedy continuation (N_NEW tokens, eos never stops it)."""
    import transformers

    hf = transformers.Llama4ForConditionalGeneration.from_pretrained(
        l4_dir, dtype=torch.float32).eval()
    memo: dict[tuple[int, ...], list[int]] = {}

    def greedy(prompts: list[list[int]]) -> list[list[int]]:
        for p in prompts:
            if tuple(p) not in memo:
                ids = torch.tensor([p])
                with torch.inference_mode():
                    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=N_NEW, min_new_tokens=None,
                                      eos_token_id=[VOCAB + 1], pad_token_id=0)
                memo[tuple(p)] = out[0, len(p):].tolist()
        return [memo[tuple(p)] for p in prompts]

    return greedy


def _llm(model_dir: Path, **kw) -> LLM:
    return LLM(str(model_dir), max_model_len=72, kv_cache_memory=4 << 20, warm_up=False, **kw)


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_batch_and_chunked_prefill_match_transformers(l4_dir, reference, random_prompts,
                                                      caplog) -> None:
    prompts = random_prompts(3, 9, 40, VOCAB, seed=41)
    ref = reference(prompts)
    with caplog.at_level(logging.INFO, logger="pagefold.models.llama4"):
        llm = _llm(l4_dir)
    assert llm.engine.arch == "Llama4ForConditionalGeneration"
    assert any("skipped" in r.getMessage() and "vision tower" in r.getMessage()
               for r in caplog.records)
    assert _tokens(llm, prompts) == ref
    llm.engine.kv.check_whole()
    chunked = _llm(l4_dir, max_num_batched_tokens=7)
    assert _tokens(chunked, prompts) == ref
    chunked.engine.kv.check_whole()


def test_prefix_hit_matches_transformers(l4_dir, reference, random_prompts) -> None:
    shared = random_prompts(1, 40, 40, VOCAB, seed=23)[0]
    ps = [shared + t for t in random_prompts(2, 3, 12, VOCAB, seed=29)]
    ref = reference(ps)
    llm = _llm(l4_dir, max_num_batched_tokens=19)
    first = _tokens(llm, ps[:1])
    before = llm.engine.kv.stats.hits
    second = _tokens(llm, ps[1:])
    assert first + second == ref
    assert llm.engine.kv.stats.hits - before >= 32
    llm.engine.kv.check_whole()


def test_image_input_is_refused(l4_dir) -> None:
    llm = _llm(l4_dir)
    image = Image.fromarray(np.zeros((28, 28, 3), dtype="uint8"))
    with pytest.raises(ValueError, match="Llama4ForConditionalGeneration as loaded takes no "
                                         "image inputs"):
        llm.generate({"prompt_token_ids": [5, 6, 7], "multi_modal_data": {"image": image}},
                     GREEDY, use_tqdm=False)
    llm.engine.kv.check_whole()
