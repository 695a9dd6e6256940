"""Forks (n > 1, best_of, beam search) and preemption (swap, recompute, auto) under the hybrid
rules: attention blocks shared copy-on-write, states copied; outputs exact; pools whole."""

from __future__ import annotations

import pytest
import torch

from pagefold import LLM, BeamSearchParams, SamplingParams
from pagefold.testing.oracle import hf_greedy, load_hf_model

ARCHS = ["qwen3", "qwen3_5", "nemotron_h"]


def _prompts(ps):
    return [{"prompt_token_ids": p} for p in ps]


@pytest.fixture(scope="module", params=ARCHS)
def family_llm(request, tiny_model_factory):
    model = tiny_model_factory(request.param)
    return model, LLM(str(model))


def test_parallel_sampling_children_equal_independent_seeded_runs(family_llm, random_prompts):
    model, llm = family_llm
    prompts = random_prompts(3, 20, 50, 512, seed=11)
    fam = llm.generate(_prompts(prompts),
                       SamplingParams(n=4, temperature=0.9, seed=7, max_tokens=8), use_tqdm=False)
    assert all(len(o.outputs) == 4 for o in fam)
    for i in range(4):
        solo = llm.generate(_prompts(prompts),
                            SamplingParams(temperature=0.9, seed=7 + i, max_tokens=8),
                            use_tqdm=False)
        for f, s in zip(fam, solo):
            assert f.outputs[i].index == i
            assert f.outputs[i].token_ids == s.outputs[0].token_ids
    # The children differ (different seeds), so forking did not alias their states.
    assert any(len({tuple(c.token_ids) for c in o.outputs}) > 1 for o in fam)
    llm.engine.kv.check_whole()


def test_greedy_children_identical_and_prompt_prefilled_once(family_llm, random_prompts):
    model, llm = family_llm
    prompt = random_prompts(1, 45, 45, 512, seed=12)[0]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runner = llm.engine.runner
    llm.engine.kv.pool.reset_prefix_cache()
    before = runner.num_forward_tokens
    one = llm.generate(_prompts([prompt]), greedy, use_tqdm=False)[0]
    cost_one = runner.num_forward_tokens - before
    llm.engine.kv.pool.reset_prefix_cache()
    before, forks = runner.num_forward_tokens, llm.engine.scheduler.num_forks
    two = llm.generate(_prompts([prompt]), SamplingParams(n=2, temperature=0, max_tokens=6,
                                                          ignore_eos=True), use_tqdm=False)[0]
    cost_two = runner.num_forward_tokens - before
    assert two.outputs[0].token_ids == two.outputs[1].token_ids == one.outputs[0].token_ids
    assert one.outputs[0].token_ids == hf_greedy(model, [prompt], 6)[0]
    assert llm.engine.scheduler.num_forks == forks + 1
    # Prompt once (len - 1 shared tokens), then each child: its last prompt token + outputs.
    assert cost_one == len(prompt) + 5
    assert cost_two == (len(prompt) - 1) + 2 * (1 + 5)
    llm.engine.kv.check_whole()


def test_best_of_returns_highest_cumulative_logprob(family_llm, random_prompts):
    _, llm = family_llm
    prompts = random_prompts(2, 10, 30, 512, seed=13)
    outs = llm.generate(_prompts(prompts), SamplingParams(n=2, best_of=4, temperature=1.0,
                                                          seed=3, max_tokens=6), use_tqdm=False)
    for o in outs:
        assert len(o.outputs) == 2 and o.outputs[0].logprobs is None
        cum = [c.cumulative_logprob for c in o.outputs]
        assert cum[0] >= cum[1]
    llm.engine.kv.check_whole()


def _reference_beam_search(model_dir, prompt, width, steps, eos):
    """Straightforward beam search over the transformers model (vLLM's semantics, scored here:
    cumulative logprob over the length, prompt included, a final EOS not)."""

    def score(toks, cum):
        return cum / (len(toks) - (toks[-1] == eos))

    m = load_hf_model(model_dir)
    beams, done = [(list(prompt), 0.0)], []
    for _ in range(steps):
        cands = []
        for toks, cum in beams:
            with torch.no_grad():
                lp = torch.log_softmax(m(torch.tensor([toks])).logits[0, -1].float(), -1)
            top = torch.topk(lp, 2 * width)
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                (done if t == eos else cands).append((toks + [t], cum + v))
        cands.sort(key=lambda x: score(*x), reverse=True)
        beams = cands[:width]
    done += beams
    done.sort(key=lambda x: score(*x), reverse=True)
    return done[:width]


def test_beam_search_equals_reference(family_llm, random_prompts):
    model, llm = family_llm
    prompts = random_prompts(3, 10, 40, 512, seed=2)
    width, steps = 3, 5
    forks = llm.engine.scheduler.num_forks
    outs = llm.beam_search(_prompts(prompts), BeamSearchParams(beam_width=width, max_tokens=steps))
    for p, o in zip(prompts, outs):
        ref = _reference_beam_search(model, p, width, steps, llm.engine.eos_token_id)
        assert [s.tokens for s in o.sequences] == [r[0] for r in ref]
        for s, r in zip(o.sequences, ref):
            assert s.cum_logprob == pytest.approx(r[1], abs=1e-3)
    assert llm.engine.scheduler.num_forks > forks  # beams really forked
    llm.engine.kv.check_whole()


# Pools small enough that every scenario preempts (block counts differ per architecture).
SMALL_POOL = {"qwen3": 300_000, "qwen3_5": 150_000, "nemotron_h": 160_000}


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_swap_recompute_auto_exact(arch, tiny_model_factory, random_prompts):
    model = tiny_model_factory(arch)
    n, new = (16, 10) if arch == "qwen3" else (10, 8)
    prompts = random_prompts(n, 5, 90, 512, seed=1)
    ref = hf_greedy(model, prompts, new)
    greedy = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    for mode in ("swap", "recompute", "auto"):
        llm = LLM(str(model), kv_cache_memory=SMALL_POOL[arch], max_model_len=128,
                  preemption_mode=mode, swap_space="8MiB")
        outs = llm.generate(_prompts(prompts), greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref, mode
        kinds = llm.engine.scheduler.preemptions_by_kind
        assert sum(kinds.values()) > 0, mode
        if mode != "auto":
            assert set(kinds) == {mode}
        if mode == "swap":
            stats = llm.engine.kv.swap_stats
            assert stats.swaps_in == stats.swaps_out > 0 and stats.bytes_in == stats.bytes_out
        llm.engine.kv.check_whole()  # device pool and host pool


def test_recompute_resumes_from_checkpoints_with_credit(qwen3_5_dir, random_prompts):
    """A hybrid preempted by recompute gets back its cached attention blocks and a state
    checkpoint: fewer tokens are recomputed than were already processed."""
    prompts = random_prompts(6, 60, 90, 512, seed=21)
    llm = LLM(str(qwen3_5_dir), kv_cache_memory=300_000, max_model_len=160,
              preemption_mode="recompute")
    outs = llm.generate(_prompts(prompts), SamplingParams(temperature=0, max_tokens=40,
                                                          ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(qwen3_5_dir, prompts, 40)
    log = llm.engine.kv.preempt_log
    assert log.recompute > 0
    assert 0 < log.credited_tokens <= log.recomputed_tokens
    llm.engine.kv.check_whole()


def test_no_request_is_requeued_forever(qwen3_dir):
    """A family that cannot run side by side in a tiny pool still finishes: victims come from
    the tail, and a request preempted repeatedly is spared while other victims exist."""
    llm = LLM(str(qwen3_dir), kv_cache_memory=230_000, max_model_len=128,
              preemption_mode="recompute")
    prompt = list(range(5, 65))
    out = llm.generate(_prompts([prompt]), SamplingParams(n=6, temperature=0.8, seed=1,
                                                          max_tokens=60, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [len(c.token_ids) for c in out.outputs] == [60] * 6
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.kv.check_whole()
    # A prompt that can never fit is refused up front with the limit named.
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(_prompts([list(range(5, 200))]), SamplingParams(max_tokens=1),
                     use_tqdm=False)
    llm.engine.kv.check_whole()


def test_family_larger_than_the_pool_still_completes(qwen3_5_dir):
    """n=8 children cannot all hold a state at once in this pool: the ones that do not fit
    start as waiting requests instead of the family waiting forever; each child still equals
    an independent run with its seed."""
    llm = LLM(str(qwen3_5_dir), kv_cache_memory=140_000, max_model_len=128)
    prompt = {"prompt_token_ids": list(range(5, 80))}
    fam = llm.generate([prompt], SamplingParams(n=8, temperature=1.0, seed=0, max_tokens=12,
                                                ignore_eos=True), use_tqdm=False)[0]
    assert [len(c.token_ids) for c in fam.outputs] == [12] * 8
    solo = llm.generate([prompt], SamplingParams(temperature=1.0, seed=5, max_tokens=12,
                                                 ignore_eos=True), use_tqdm=False)[0]
    assert fam.outputs[5].token_ids == solo.outputs[0].token_ids
    llm.engine.kv.check_whole()


def test_forked_children_cache_their_own_blocks(family_llm, random_prompts):
    """Children of one prompt grow different tokens into their blocks: each block must be
    cached under its own child's hash chain. A follow-up turn on each child's conversation
    hits those blocks and must still continue exactly as transformers does."""
    model, llm = family_llm
    llm.engine.kv.pool.reset_prefix_cache()
    prompts = random_prompts(2, 18, 22, 512, seed=21)
    fam = llm.generate(_prompts(prompts), SamplingParams(n=3, temperature=1.0, seed=5,
                                                         max_tokens=40, ignore_eos=True),
                       use_tqdm=False)
    follow = [p + list(c.token_ids) + [7, 8, 9] for p, o in zip(prompts, fam) for c in o.outputs]
    assert len({tuple(f) for f in follow}) == len(follow)  # the children differ
    got = llm.generate(_prompts(follow), SamplingParams(temperature=0, max_tokens=4,
                                                        ignore_eos=True), use_tqdm=False)
    assert all(o.num_cached_tokens >= 32 for o in got)  # the children's blocks were hit
    assert [o.outputs[0].token_ids for o in got] == hf_greedy(model, follow, 4)
    llm.engine.kv.check_whole()


def test_abort_of_a_family_id_aborts_every_child(family_llm, random_prompts):
    """n > 1 forks children after the prompt; aborting the request id the user knows must
    abort them all (a client disconnect on a streamed n=3 request), leaving nothing running."""
    model, llm = family_llm
    engine = llm.engine
    prompt = random_prompts(1, 30, 30, 512, seed=31)[0]
    engine.add_request("fam", prompt, SamplingParams(n=3, temperature=1.0, seed=3,
                                                     max_tokens=200, ignore_eos=True))
    for _ in range(50):  # until the children exist and decode
        engine.step()
        kids = [r for r in engine.scheduler.requests.values() if r.parent_id == "fam"]
        if kids and all(r.num_output_tokens >= 2 for r in kids):
            break
    assert len(kids) >= 2
    engine.abort(["fam"])
    assert not engine.scheduler.requests
    while engine.has_unfinished():
        engine.step()
    engine.kv.check_whole()
