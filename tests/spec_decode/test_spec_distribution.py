"""temperature > 0 with a draft model keeps the target's distribution (rejection sampling with
the draft's ``q``): over many seeds, the second generated token (the first one a verify step
emits: an accepted draft or a draw from the residual) follows the exact marginal
``sum_t1 p(t1) p(t2 | t1)`` computed with transformers; a chi-square test decides.

Seeds are fixed, so the test is deterministic; the bound (p < 1e-4 to fail) leaves room for
float differences between the engine and the reference. It catches drafts that do not come
from the ``q`` handed to the verifier (e.g. argmax drafts with softmax ``q``: p ~ 1e-18);
the sampler's own arithmetic is tested with more power in ``test_rejection.py``.

The same check runs on a Gated DeltaNet hybrid (Qwen3.5) with a hybrid draft model and with
an EAGLE-3 head (whose ``q`` lives on its draft vocabulary, mapped through ``d2t``), on the
first token too; there the test also proves its own power against an "always accept" rule:
under it the second token would follow the drafter's marginal ``sum_t1 p(t1) q(t2 | t1)``,
and the chi-square statistic those expected counts give must be decisive (p < 1e-6).
"""

from __future__ import annotations

import math

import pytest
import torch

from pagefold import LLM, SamplingParams
from pagefold.testing.oracle import load_hf_model
from pagefold.testing.spec_models import perturbed_copy, write_eagle_head

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


def _two_token_law(model_dir, prompt: list[int], temperature: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p(t1), p(t1, t2))`` of the model at ``model_dir`` after ``prompt`` (float64). The
    rows of first tokens outside the smallest set holding all but 1e-9 of ``p(t1)`` are left
    zero (no sample of the test is expected to start there)."""
    hf = load_hf_model(model_dir)
    with torch.inference_mode():
        first = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double() / temperature,
                              dim=0)
        order = first.argsort(descending=True)
        keep = order[: int((first[order].cumsum(0) < 1 - 1e-9).sum()) + 1]
        batch = torch.cat([torch.tensor([prompt]).expand(len(keep), -1),
                           keep.unsqueeze(1)], dim=1)
        second = torch.softmax(hf(batch).logits[:, -1].double() / temperature, dim=1)
    joint = torch.zeros(first.shape[0], first.shape[0], dtype=torch.float64)
    joint[keep] = first[keep].unsqueeze(1) * second
    return first, joint


def _chi2(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom) over the cells expecting >= 5 plus the pooled rest."""
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().unsqueeze(0)])
    exp = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)])
    return float(((obs - exp) ** 2 / exp.clamp(min=1e-9)).sum()), int(big.sum())


N_HYBRID = 320
BATCH = 64  # one generate call per batch: a hybrid drafts only on steps without prefill work


@pytest.mark.parametrize("drafter", ["draft_model", "eagle3"])
def test_hybrid_sampling_keeps_the_target_distribution(tiny_model_factory, tmp_path,
                                                       drafter: str) -> None:
    target = tiny_model_factory("qwen3_5")
    prompt = [5, 17, 301, 42, 77, 9, 130]
    temp = 0.25  # the tiny hybrid's second token is flat at 0.5: ~12 cells of >= 5 here
    p1, joint = _two_token_law(target, prompt, temp)
    p2 = joint.sum(0)
    if drafter == "draft_model":
        draft = perturbed_copy(target, tmp_path / "draft", 0.3, seed=1)
        spec = {"model": str(draft)}
        # Power: under "always accept" t2 would follow sum_t1 p(t1) q(t2 | t1).
        q1, q_joint = _two_token_law(draft, prompt, temp)
        cond = torch.where(q1.unsqueeze(1) > 0, q_joint / q1.unsqueeze(1), 0.0)
        mutant = (p1.unsqueeze(1) * cond).sum(0)
        stat, df = _chi2(mutant * N_HYBRID, p2 * N_HYBRID)
        assert _chi2_sf(stat, df) < 1e-6, (stat, df)
    else:
        head = write_eagle_head(target, tmp_path / "eagle3", "eagle3", seed=5, std=0.3,
                                draft_vocab=200)
        spec = {"method": "eagle3", "model": str(head)}
    llm = LLM(str(target), max_model_len=64, max_num_seqs=BATCH,
              speculative_config=spec | {"num_speculative_tokens": 2,
                                         "disable_by_batch_size": 2 * BATCH})
    llm.engine.spec.MAX_BACKOFF = 1  # draft on every decode step, rejected or not
    c1 = torch.zeros_like(p1)
    c2 = torch.zeros_like(p2)
    for b in range(0, N_HYBRID, BATCH):
        params = [SamplingParams(temperature=temp, seed=s, max_tokens=3, ignore_eos=True)
                  for s in range(b, b + BATCH)]
        for o in llm.generate([{"prompt_token_ids": prompt}] * BATCH, params, use_tqdm=False):
            c1[o.outputs[0].token_ids[0]] += 1
            c2[o.outputs[0].token_ids[1]] += 1
    m = llm.engine.spec.metrics
    assert m.num_drafts >= N_HYBRID  # every second token came out of a verify step
    if drafter == "draft_model":  # both branches of the sampler (a random head: rejections)
        assert 0 < m.num_accepted_tokens < m.num_draft_tokens
    for counts, law in ((c1, p1), (c2, p2)):
        stat, df = _chi2(counts, law * N_HYBRID)
        assert df >= 5
        assert _chi2_sf(stat, df) > 1e-4, (stat, df)
    llm.engine.kv.check_whole()
