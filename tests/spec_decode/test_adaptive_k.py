"""adaptive_k: each request's k follows its acceptance history; tokens unchanged."""

from __future__ import annotations

import torch

from pagefold import LLM, SamplingParams
from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_cache_planner import plan_pagefold
from pagefold.core.kv_cache_spec import FullAttentionSpec
from pagefold.core.sched_output import SampledToken, SchedulerOutput, VerifiedTokens
from pagefold.core.scheduler import Scheduler
from pagefold.request import Request
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


def test_backoff_doubles_after_each_round_with_nothing_accepted() -> None:
    """The documented back-off: a round accepting nothing doubles the steps the request then
    decodes without drafts (2, 4, 8, 16, capped at 16); an accepted draft resets it."""
    attn = FullAttentionSpec(num_kv_heads=1, head_dim=4, dtype=torch.float32)
    s = Scheduler(KVCacheManager(plan_pagefold({"a": attn}, 4, 64 * attn.page_bytes(4))),
                  max_num_batched_tokens=64, max_num_seqs=4, max_model_len=512)
    s.add_request(Request("r", [1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True)))
    out = s.schedule()
    s.update_from_output(out, {"r": SampledToken(4)})  # decoding: one token to compute
    dec = SpecDecoder(SpeculativeConfig.from_user(
        {"method": "ngram", "num_speculative_tokens": 2}), 512)
    dec.propose_fn = lambda req, k: [5] * k

    def rounds(steps: int, accepted: int) -> list[int]:
        drafted = []
        for step in range(steps):
            dec.propose(s)
            d = s.spec_token_ids.get("r")
            if d:
                drafted.append(step)
                dec.observe(SchedulerOutput(spec_token_ids={"r": d}),
                            {"r": VerifiedTokens([6] * (accepted + 1), accepted)})
        return drafted

    # Waits of 2, 4, 8, 16 and (capped) 16 steps after each failed round.
    assert rounds(50, 0) == [0, 2, 6, 14, 30, 46]
    assert rounds(13, 1) == [12]  # the round after the capped wait (46 + 16) ...
    assert rounds(3, 1) == [0, 1, 2]  # ... accepted a draft: no wait any more
