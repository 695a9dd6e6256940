"""EAGLE-3 and draft-model speculation on every architecture pagefold serves (one tiny model
per entry of ``pagefold.testing.tiny_models.ARCHS``: dense, sliding window, chunked local,
MoE, GDN, Mamba-2, Mamba-1, short conv, lightning, KDA + MLA, Zamba2's shared blocks).

Per architecture, one engine with an EAGLE-3 head (random, in the public layout, its
attention pages sized like the target's) and 7-token prefill chunks:

* a pass with speculation switched off (``disable_by_batch_size`` 1) gives the reference
  greedy tokens (the engine without speculation equals transformers: the model tests) and
  fills the prefix cache;
* a pass with the head drafting, over the same prompts (prefix hits) with one decoding
  request preempted, gives the same tokens; every round's drafts equal an independent
  implementation of the head over transformers' hidden states entering layers
  ``(2, n // 2, n - 3)`` (``tests/spec_decode/eagle_reference.py``): the decoder stack's
  layer-input capture and the target's embedding are right on this architecture.

Then a draft model that is an exact copy of the target (acceptance near 100%, so accepted
drafts commit the states of the target and of the draft: a wrong commit loses acceptance
or changes tokens) gives the same tokens, and so does the n-gram method's engine-side path
(drafts from the reference with some corrupted, as ``test_engine_spec.py`` does) with a
preemption on the architectures that file does not cover.
"""

from __future__ import annotations

import pytest

from pagefold import LLM, SamplingParams
from pagefold.testing import tiny_models
from pagefold.testing.spec_models import perturbed_copy, write_eagle_head
from tests.spec_decode.eagle_reference import check_drafts, record_drafts
from tests.spec_decode.test_engine_spec import ARCHS as ENGINE_SPEC_ARCHS

K = 2
NEW = 8
# Prompts past one 16-token block: the second pass hits the cache (hybrids: a checkpoint).
PROMPTS = tiny_models.random_prompts(3, 19, 23, 512, seed=29)
# The architectures whose n-gram speculation test_engine_spec.py does not run.
NGRAM_HERE = sorted(set(tiny_models.ARCHS) - set(ENGINE_SPEC_ARCHS))
POOL = 4 << 20  # bytes: a small pool is zeroed fast (a default one takes seconds)


def _spec(**kw) -> dict:
    return {"num_speculative_tokens": K, "disable_by_batch_size": 64, **kw}


def _generate(llm: LLM, preempt: bool = False, prompts=PROMPTS
              ) -> tuple[list[list[int]], int]:
    """Greedy tokens per prompt and the prompt tokens served from the cache; ``preempt``:
    preempt the last decoding request once (the pool's mode) after the first step with one."""
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    ids = [llm.add_request({"prompt_token_ids": p}, sp) for p in prompts]
    final: dict = {}
    sched = llm.engine.scheduler
    while len(final) < len(ids):
        final.update({o.request_id: o for o in llm.step() if o.finished})
        decoding = [r for r in sched.running if r.num_computed_tokens > r.num_prompt_tokens]
        if preempt and decoding:
            sched._preempt(decoding[-1])
            preempt = False
    assert not preempt, "no request was decoding"
    outs = [final[i] for i in ids]
    return [list(o.outputs[0].token_ids) for o in outs], sum(o.num_cached_tokens for o in outs)


def _oracle(llm: LLM, ref: list[list[int]]) -> None:
    """Engine-side drafts (the n-gram method's path) from the reference continuation, every
    third one corrupted: partial acceptance (random models rarely repeat, so prompt lookup
    itself would find almost nothing to draft)."""
    table = {tuple(p): r for p, r in zip(PROMPTS, ref)}

    def propose(req, k):
        n = req.num_output_tokens
        d = list(table[tuple(req.prompt_token_ids)][n : n + k])
        return [(t + 1) % 512 if (n + j) % 3 == 2 else t for j, t in enumerate(d)]

    llm.engine.spec.propose_fn = propose


@pytest.mark.parametrize("arch", tiny_models.ARCHS)
def test_eagle3_and_draft_greedy_equal_no_speculation(arch: str, tiny_model_factory,
                                                      tmp_path) -> None:
    target = tiny_model_factory(arch)
    head = write_eagle_head(target, tmp_path / "eagle3", "eagle3", seed=3, draft_vocab=300)
    llm = LLM(str(target), max_model_len=64, max_num_batched_tokens=7, kv_cache_memory=POOL,
              speculative_config=_spec(method="eagle3", model=str(head)))
    spec = llm.engine.spec
    spec.disable_by_batch_size = 1  # the reference: no request is speculated
    ref, _ = _generate(llm)
    assert spec.metrics.num_drafts == 0
    spec.disable_by_batch_size = 64
    seen = record_drafts(llm)
    got, cached = _generate(llm, preempt=True)
    assert got == ref
    assert cached > 0 and llm.engine.scheduler.num_preemptions == 1
    assert check_drafts(target, head, "eagle3", [p + r for p, r in zip(PROMPTS, ref)],
                        seen) >= 3
    llm.engine.kv.check_whole()

    draft = perturbed_copy(target, tmp_path / "draft", 0.0)
    llm = LLM(str(target), max_model_len=64, max_num_batched_tokens=7, kv_cache_memory=POOL,
              speculative_config=_spec(model=str(draft)))
    got, _ = _generate(llm)
    assert got == ref
    m = llm.engine.spec.metrics
    assert m.num_drafts >= 2 and m.acceptance_rate > 0.9, m.summary()
    llm.engine.kv.check_whole()

    if arch in NGRAM_HERE:
        llm = LLM(str(target), max_model_len=64, max_num_batched_tokens=7, kv_cache_memory=POOL,
                  speculative_config=_spec(method="ngram", prompt_lookup_max=3,
                                           prompt_lookup_min=1))
        _oracle(llm, ref)
        # One request at a time: a hybrid drafts only on steps without prefill work.
        got = [_generate(llm, i == 0, [p])[0][0] for i, p in enumerate(PROMPTS)]
        m = llm.engine.spec.metrics
        assert got == ref and 0 < m.num_accepted_tokens < m.num_draft_tokens, m.summary()
        llm.engine.kv.check_whole()
