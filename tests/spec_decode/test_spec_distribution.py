"""temperature > 0 with a draft model keeps the target's distribution (rejection sampling with
the draft's ``q``): over many seeds, the second generated token (the first one a verify step
emits: an accepted draft or a draw from the residual) follows the exact marginal
``sum_t1 p(t1) p(t2 | t1)`` computed with transformers; a chi-square test decides.

Seeds are fixed, so the test is deterministic; the bound (p < 1e-4 to fail) leaves room for
float differences between the engine and the reference. It catches drafts that do not come
from the ``q`` handed to the verifier (e.g. argmax drafts with softmax ``q``: p ~ 1e-18);
the sampler's own arithmetic is tested with more power in ``test_rejection.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagefold import LLM, SamplingParams
from pagefold.testing.oracle import load_hf_model
from pagefold.testing.spec_models import perturbed_copy

N = 600


def _exact_second_token(model_dir, prompt: list[int], temperature: float) -> torch.Tensor:
    hf = load_hf_model(model_dir)
    with torch.inference_mode():
        first = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double() / temperature,
                              dim=0)
        v = first.shape[0]
        batch = torch.cat([torch.tensor([prompt]).expand(v, -1),
                           torch.arange(v).unsqueeze(1)], dim=1)
        second = torch.softmax(hf(batch).logits[:, -1].double() / temperature, dim=1)
    return first @ second


def _chi2_sf(x: float, df: int) -> float:
    """Survival function of the chi-square distribution (Wilson-Hilferty approximation)."""
    z = ((x / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.slow
def test_draft_model_sampling_keeps_the_target_distribution(tiny_model_factory, tmp_path):
    target = tiny_model_factory("qwen3")
    draft = perturbed_copy(target, tmp_path / "draft", 0.3, seed=1)
    prompt = [5, 17, 301, 42, 77, 9, 130]
    temp = 0.5  # ~17 cells of >= 5 expected at N = 600; drafts partly rejected
    exact = _exact_second_token(target, prompt, temp)
    llm = LLM(str(target), max_model_len=64, max_num_seqs=32,
              speculative_config={"model": str(draft), "num_speculative_tokens": 2,
                                  "disable_by_batch_size": 64})
    params = [SamplingParams(temperature=temp, seed=s, max_tokens=3, ignore_eos=True)
              for s in range(N)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * N, params, use_tqdm=False)
    m = llm.engine.spec.metrics
    assert 0 < m.num_accepted_tokens < m.num_draft_tokens  # both branches of the sampler
    counts = torch.zeros_like(exact)
    for o in outs:
        counts[o.outputs[0].token_ids[1]] += 1
    expected = exact * N
    big = expected >= 5  # chi-square cells; the rest is pooled into one
    obs = torch.cat([counts[big], counts[~big].sum().unsqueeze(0)])
    exp = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)])
    stat = float(((obs - exp) ** 2 / exp.clamp(min=1e-9)).sum())
    df = int(big.sum())
    assert df >= 5
    assert _chi2_sf(stat, df) > 1e-4, (stat, df)
    llm.engine.kv.check_whole()
