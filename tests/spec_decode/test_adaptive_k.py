"""adaptive_k: each request's k follows its acceptance history; tokens unchanged."""

from __future__ import annotations

from pagefold import LLM, SamplingParams
from pagefold.spec_decode.config import SpeculativeConfig
from pagefold.spec_decode.engine import SpecDecoder
from pagefold.testing.oracle import hf_greedy


def test_next_k_rule() -> None:
    dec = SpecDecoder(SpeculativeConfig.from_user(
        {"method": "ngram", "num_speculative_tokens": 4, "adaptive_k": True}), 128)
    assert dec.next_k(4, 4) == 4  # all accepted at the cap: stays
    assert dec.next_k(2, 2) == 3  # all accepted: one more
    assert dec.next_k(4, 1) == 2  # one accepted: one more than that
    assert dec.next_k(3, 0) == 1


def test_adaptive_k_drafts_what_gets_accepted(tiny_model_factory, random_prompts) -> None:
    """An oracle drafter whose first draft is always right and second always wrong: with
    adaptive_k the rounds shrink to 2 drafts, without it they stay at 3; tokens equal."""
    model = tiny_model_factory("qwen3")
    prompts = random_prompts(3, 5, 30, 512, seed=21)
    ref = hf_greedy(model, prompts, 12)
    table = {tuple(p): r for p, r in zip(prompts, ref)}
    rates = {}
    for adaptive in (False, True):
        llm = LLM(str(model), max_model_len=96, speculative_config={
            "method": "ngram", "num_speculative_tokens": 3, "adaptive_k": adaptive})

        def propose(req, k):
            cont = table[tuple(req.prompt_token_ids)]
            d = list(cont[req.num_output_tokens : req.num_output_tokens + k])
            return [t if j == 0 else (t + 1) % 512 for j, t in enumerate(d)]

        llm.engine.spec.propose_fn = propose
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
        m = llm.engine.spec.metrics
        rates[adaptive] = m.num_draft_tokens / m.num_drafts
        llm.engine.kv.check_whole()
    assert rates[False] > 2.5 and rates[True] < 2.3, rates
