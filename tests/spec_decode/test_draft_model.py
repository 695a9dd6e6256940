"""Draft-model speculation: greedy tokens with a draft model equal transformers' (float32) and
speculation off, for a dense (Qwen3), a Gated DeltaNet hybrid (Qwen3.5) and a Mamba-1 hybrid
(Jamba) target, under batching, chunked prefill at an odd chunk size, preemption, prefix hits
and n=2; the pool is whole after each scenario.

Drafts: ``self`` is an exact copy of the target (it agrees with the target on every greedy
token, so acceptance is near 100% unless its caches or recurrent states fall out of step with
the target's: a wrong draft commit shows up as lost acceptance); ``noisy`` is the target with
noise (every accepted length 0..k occurs).
"""

from __future__ import annotations

import pytest

from pagefold import LLM, SamplingParams
from pagefold.testing import tiny_models
from pagefold.testing.oracle import hf_greedy
from pagefold.testing.spec_models import perturbed_copy

K = 3
NEW = 10
# Partial acceptance (the hybrids are more sensitive). Jamba: a Mamba-1 target and draft.
NOISE = {"qwen3": 0.1, "qwen3_5": 0.01, "jamba": 0.01}
SMALL_POOL = {"qwen3": 350_000, "qwen3_5": 230_000, "jamba": 260_000}


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5", "jamba"])
def case(request, tiny_model_factory, tmp_path_factory):
    arch = request.param
    target = tiny_model_factory(arch)
    root = tmp_path_factory.mktemp(f"drafts-{arch}")
    drafts = {"self": perturbed_copy(target, root / "self", 0.0),
              "noisy": perturbed_copy(target, root / "noisy", NOISE[arch], seed=1)}
    prompts = tiny_models.random_prompts(6, 5, 40, 512, seed=11)
    ref = hf_greedy(target, prompts, NEW)
    return arch, target, drafts, prompts, ref


def _spec(draft) -> dict:
    return {"model": str(draft), "num_speculative_tokens": K, "disable_by_batch_size": 64}


def _gen(llm: LLM, prompts, n: int = 1, **kw):
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, n=n, **kw)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


@pytest.mark.parametrize("scenario", ["chunk7", "preempt", "prefix_fork"])
def test_draft_model_greedy_equals_transformers(case, scenario: str) -> None:
    arch, target, drafts, prompts, ref = case
    kw: dict = {"max_model_len": 96}
    draft = drafts["noisy"] if scenario == "chunk7" else drafts["self"]
    if scenario == "chunk7":
        kw["max_num_batched_tokens"] = 7
    if scenario == "preempt":
        kw |= {"kv_cache_memory": SMALL_POOL[arch], "preemption_mode": "auto",
               "swap_space": "8MiB", "max_num_batched_tokens": 29}
    llm = LLM(str(target), speculative_config=_spec(draft), **kw)
    assert [o.outputs[0].token_ids for o in _gen(llm, prompts)] == ref
    m = llm.engine.spec.metrics
    assert m.num_drafts > 0
    if scenario == "chunk7":  # a noisy draft: partial acceptance, every length occurs
        assert 0 < m.num_accepted_tokens < m.num_draft_tokens
        assert m.accepted_per_pos[0] > m.accepted_per_pos[K - 1] > 0
    else:  # an exact copy stays in step with the target: (almost) everything is accepted
        assert m.acceptance_rate > 0.9, m.summary()
    if scenario == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    if scenario == "prefix_fork":
        # The draft's layers are cache groups of the target's pool (capacity counts them).
        names = [n for g in llm.engine.kv_config.groups for n in g.layer_names]
        assert sum(n.startswith("draft.") for n in names) == len(names) // 2
        again = _gen(llm, prompts)
        assert [o.outputs[0].token_ids for o in again] == ref
        assert sum(o.num_cached_tokens for o in again) > 0
        fam = _gen(llm, prompts[:3], n=2)
        for o, r in zip(fam, ref[:3]):
            assert [c.token_ids for c in o.outputs] == [r, r]
        assert m.acceptance_rate > 0.9, m.summary()
    llm.engine.kv.check_whole()


def test_hybrid_draft_for_a_dense_target(tiny_model_factory, random_prompts) -> None:
    """A GDN hybrid draft (random, so mostly rejected) for a dense target: exact, and the
    target alone (no state layers) still drafts only on steps without prefill."""
    target = tiny_model_factory("qwen3")
    draft = tiny_model_factory("qwen3_5", seed=3)
    prompts = random_prompts(2, 5, 30, 512, seed=4)
    llm = LLM(str(target), max_model_len=96, max_num_batched_tokens=9,
              speculative_config=_spec(draft))
    assert llm.engine.spec.has_state  # the draft's states count
    assert [o.outputs[0].token_ids for o in _gen(llm, prompts)] == hf_greedy(target, prompts,
                                                                             NEW)
    assert llm.engine.spec.metrics.num_drafts > 0
    llm.engine.kv.check_whole()


def test_sampling_with_a_draft_model(case) -> None:
    """temperature > 0: drafts drawn from the draft's distribution (kept for rejection
    sampling); seeded runs repeat exactly; penalties and logprobs ride along."""
    arch, target, drafts, prompts, ref = case
    if arch != "qwen3":
        pytest.skip("one architecture is enough here")
    llm = LLM(str(target), max_model_len=96, speculative_config=_spec(drafts["noisy"]))
    sp = SamplingParams(temperature=0.9, seed=5, max_tokens=NEW, ignore_eos=True, logprobs=2,
                        presence_penalty=0.3, n=2)
    one = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], sp, use_tqdm=False)
    two = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], sp, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in one] == [
        [c.token_ids for c in o.outputs] for o in two]
    assert all(len(c.token_ids) == NEW and len(c.logprobs) == NEW
               for o in one for c in o.outputs)
    assert llm.engine.spec.metrics.num_accepted_tokens > 0
    # Beam search (never speculated; the draft's caches are forked with the beams) and then
    # greedy drafting again on the same engine.
    from pagefold import BeamSearchParams

    bp = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    plain = LLM(str(target), max_model_len=96)
    beams = [[s.tokens for s in o.sequences]
             for o in llm.beam_search([{"prompt_token_ids": p} for p in prompts[:2]], bp)]
    assert beams == [[s.tokens for s in o.sequences] for o in plain.beam_search(
        [{"prompt_token_ids": p} for p in prompts[:2]], bp)]
    assert [o.outputs[0].token_ids for o in _gen(llm, prompts[:2])] == ref[:2]
    llm.engine.kv.check_whole()


def test_bad_draft_models_are_refused(tiny_model_factory, tmp_path) -> None:
    target = tiny_model_factory("qwen3")
    other_vocab = tiny_model_factory("qwen3", vocab_size=384)
    with pytest.raises(ValueError, match="vocab_size .* differs"):
        LLM(str(target), speculative_config=_spec(other_vocab))
    llama = tiny_model_factory("llama")  # 2 kv heads x 16: another attention page size
    with pytest.raises(ValueError, match="attention pages"):
        LLM(str(target), speculative_config=_spec(llama))
    with pytest.raises(ValueError, match="not a local model folder"):
        LLM(str(target), speculative_config=_spec(tmp_path / "nothing"))


def test_state_layers_without_a_verify_pass_are_refused() -> None:
    """A state layer whose forward is not a known verify forward stores its state during
    every forward: speculating on it would keep rejected drafts in it, so speculation is
    refused up front -- also for a subclass of a verifying layer that replaces its forward."""
    from torch import nn

    from pagefold.layers.mamba.mamba1 import Mamba1Config, Mamba1Mixer
    from pagefold.spec_decode.verify_support import check_verify_support

    cfg = Mamba1Config(hidden_size=8, intermediate=16, state_size=4, dt_rank=2, conv_kernel=4,
                       proj_bias=False, conv_bias=True)

    class Replaced(Mamba1Mixer):
        def forward(self, x, ctx):
            return x

    ok = nn.Sequential(Mamba1Mixer(cfg, "layers.0"))
    check_verify_support(ok, {"layers.0"})
    bad = nn.Sequential(Mamba1Mixer(cfg, "layers.0"), Replaced(cfg, "layers.1"))
    check_verify_support(bad, {"layers.0"})  # layers.1 is not a state layer here
    with pytest.raises(ValueError, match="^speculative decoding cannot verify drafts on "
                       "this model's Replaced state layers yet"):
        check_verify_support(bad, {"layers.0", "layers.1"})
    with pytest.raises(ValueError, match="on the draft model's Replaced state layers"):
        check_verify_support(bad, {"layers.1"}, "the draft model")
