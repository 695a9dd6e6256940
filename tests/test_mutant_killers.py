"""Tests written to kill specific one-line mutants that survived the suite (issue 16):
the top-p boundary, per-row min_p in a mixed batch, exact recompute credit, and a hybrid's
decode-time checkpoint hit compared token for token with the cache off."""

from __future__ import annotations

import pytest
import torch
from test_sampler import PROBS4, _frequencies, _logits4, _meta, sampler

from pagefold import LLM, SamplingParams
from pagefold.testing.tiny_models import random_prompts


def _same_run(a, b, tol: float = 1e-4) -> None:
    """Same tokens and the same sampled-token logprobs: the tiny random hybrids forget old
    tokens fast, so a state a block short can still pick the same greedy tokens -- its
    logprobs move by ~1e-2, while a correct restore matches to float rounding."""
    assert a.token_ids == b.token_ids
    la = [e[t].logprob for t, e in zip(a.token_ids, a.logprobs)]
    lb = [e[t].logprob for t, e in zip(b.token_ids, b.logprobs)]
    worst = max(abs(x - y) for x, y in zip(la, lb))
    assert worst < tol, worst


# ----------------------------------------------------------------------------- sampler
@pytest.mark.parametrize("top_p,kept", [(0.25, 1), (0.5, 2), (0.75, 3), (0.5 + 1e-6, 3),
                                        (0.25 - 1e-6, 1), (1.0, 4)])
def test_top_p_exactly_at_the_threshold(top_p, kept):
    """Four equal logits: probabilities are exactly 0.25 each, so the mass before the k-th
    sorted token is exactly (k-1)/4. A token whose preceding mass already reaches p is
    dropped: p = 0.5 keeps exactly two tokens (the smallest set whose mass reaches p)."""
    torch.manual_seed(0)
    n = 4000
    logits = torch.zeros(n, 4)
    out = sampler(logits, _meta([SamplingParams(top_p=top_p)] * n)).sampled_token_ids
    freq = _frequencies(out, 4)
    assert int((freq > 0).sum()) == kept, freq
    assert torch.allclose(freq[freq > 0], torch.full((kept,), 1 / kept), atol=0.04), freq


def test_min_p_per_row_in_a_mixed_batch():
    """Rows with different min_p (and rows without) side by side: each row's distribution is
    its own setting's, whatever its neighbours ask."""
    torch.manual_seed(1)
    settings = [SamplingParams(min_p=0.2), SamplingParams(), SamplingParams(min_p=0.7),
                SamplingParams(temperature=0.0), SamplingParams(min_p=0.05)]
    n = len(settings) * 3000
    params = settings * (n // len(settings))
    out = sampler(_logits4(n), _meta(params)).sampled_token_ids
    k = len(settings)
    exp = [
        [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0],  # threshold 0.1: drops 0.05
        PROBS4,  # min_p off
        [1.0, 0.0, 0.0, 0.0],  # threshold 0.35: only the best
        [1.0, 0.0, 0.0, 0.0],  # greedy
        PROBS4,  # threshold 0.025: keeps all
    ]
    for i in range(k):
        freq = _frequencies(out[i::k], 4)
        want = torch.tensor(exp[i])
        assert torch.all(freq[want == 0] == 0), (i, freq)
        assert torch.allclose(freq, want, atol=0.03), (i, freq)


# ----------------------------------------------------------------------------- recompute credit
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_recompute_credit_is_exactly_what_comes_back(arch, tiny_model_factory):
    """Preempt a decoding request by recompute between two steps: the credit logged is the
    prefix hit its re-admission actually gets (and, for a dense model, every full computed
    block); the output equals an uninterrupted run."""
    d = tiny_model_factory(arch)
    llm = LLM(str(d), max_model_len=256, kv_cache_memory="8MiB", preemption_mode="recompute",
              state_checkpoint_interval=32, warm_up=False)
    (prompt,) = random_prompts(1, 70, 70, 512, seed=31)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    (ref,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    fresh = LLM(str(d), max_model_len=256, kv_cache_memory="8MiB", preemption_mode="recompute",
                state_checkpoint_interval=32, warm_up=False)
    rid = fresh.add_request({"prompt_token_ids": prompt}, params)
    req = fresh.engine.scheduler.requests[rid]
    outs = []
    with fresh.engine.single_steps():  # one token a step: the loop stops at 20 exactly
        while req.num_output_tokens < 20:  # 70 + 19 = 89 computed: not a block multiple
            outs += fresh.step()
    kv, sched = fresh.engine.kv, fresh.engine.scheduler
    computed = req.num_computed_tokens
    assert computed % 16
    hits_before = kv.stats.hits
    sched._preempt(req)
    credited = kv.preempt_log.credited_tokens
    assert kv.preempt_log.recomputed_tokens == computed
    if arch == "qwen3":
        assert credited == 16 * (computed // 16)
    assert 0 < credited <= computed
    while fresh.engine.has_unfinished():
        outs += fresh.step()
    assert kv.stats.hits - hits_before == credited  # the prediction is what came back
    final = [o for o in outs if o.finished][-1]
    _same_run(final.outputs[0], ref.outputs[0])
    kv.check_whole()


# ----------------------------------------------------------------------------- decode checkpoint
def test_second_turn_from_a_decode_time_checkpoint_equals_cache_off(qwen3_5_dir):
    """Turn 2 of a conversation starts from turn 1's decode-time state checkpoint (the hit
    reaches past the first prompt); its tokens equal a run with the prefix cache off."""
    kw = dict(max_model_len=256, kv_cache_memory="8MiB", state_checkpoint_interval=32,
              warm_up=False)
    on = LLM(str(qwen3_5_dir), **kw)
    off = LLM(str(qwen3_5_dir), enable_prefix_caching=False, **kw)
    p1, q = random_prompts(2, 37, 37, 512, seed=41)
    first = SamplingParams(temperature=0, max_tokens=45, ignore_eos=True)
    (t1,) = on.generate({"prompt_token_ids": p1}, first, use_tqdm=False)
    turn2 = p1 + list(t1.outputs[0].token_ids) + q[:11]
    second = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    (hit,) = on.generate({"prompt_token_ids": turn2}, second, use_tqdm=False)
    (ref,) = off.generate({"prompt_token_ids": turn2}, second, use_tqdm=False)
    assert hit.num_cached_tokens > len(p1), hit.num_cached_tokens  # a decode-time checkpoint
    _same_run(hit.outputs[0], ref.outputs[0])
    on.engine.kv.check_whole()


def test_branch_hit_at_a_prefill_checkpoint_equals_cache_off(qwen3_5_dir):
    """B shares A's first 60 tokens (3 full blocks): B's hit restores a state checkpoint A
    saved during its prefill, and B's tokens equal a run with the cache off."""
    kw = dict(max_model_len=256, kv_cache_memory="8MiB", state_checkpoint_interval=32,
              warm_up=False)
    on = LLM(str(qwen3_5_dir), **kw)
    off = LLM(str(qwen3_5_dir), enable_prefix_caching=False, **kw)
    a, other = random_prompts(2, 100, 100, 512, seed=51)
    b = a[:60] + other[:30]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    on.generate({"prompt_token_ids": a}, params, use_tqdm=False)
    (hit,) = on.generate({"prompt_token_ids": b}, params, use_tqdm=False)
    (ref,) = off.generate({"prompt_token_ids": b}, params, use_tqdm=False)
    assert 32 <= hit.num_cached_tokens <= 48
    _same_run(hit.outputs[0], ref.outputs[0])
    on.engine.kv.check_whole()


def test_top_p_one_keeps_every_token_despite_rounding():
    """One dominant logit and a long tail: float32 running mass reaches 1.0 before the tail
    ends; a row with top_p = 1 must still keep every token (and one with p < 1 may not)."""
    from pagefold.executor.sampler import apply_top_p

    logits = torch.zeros(2, 4096)
    logits[:, 7] = 30.0
    probs = logits[0].softmax(0).sort(descending=True).values
    assert (probs.cumsum(0) - probs)[-1] >= 1.0  # the rounding this test is about
    out = apply_top_p(logits.clone(), torch.tensor([1.0, 0.5]))
    assert torch.isfinite(out[0]).all()
    assert int(torch.isfinite(out[1]).sum()) == 1
