"""Offline engine reliability: Ctrl-C in the middle of ``LLM.generate`` frees the pool and
leaves the engine usable."""

from __future__ import annotations

import pytest

from pagefold import LLM, SamplingParams
from pagefold.testing.tiny_models import random_prompts


@pytest.fixture(scope="module")
def llm(qwen3_5_dir):
    return LLM(str(qwen3_5_dir), max_model_len=256, kv_cache_memory="8MiB",
               state_checkpoint_interval=32)


@pytest.mark.parametrize("where", ["execute", "after_step", "schedule"])
def test_keyboard_interrupt_mid_step_frees_the_pool(llm, monkeypatch, where):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, 40, 90, 512, seed=3)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    target = {"execute": llm.engine.runner, "after_step": llm.engine.kv,
              "schedule": llm.engine.scheduler}[where]
    real = getattr(target, where)
    calls = {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 7:  # mid-prefill of some, decoding for others
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(target, where, interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    llm.engine.kv.check_whole()
    assert not llm.engine.has_unfinished() and not llm.engine.scheduler.requests
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert again == want
    llm.engine.kv.check_whole()
