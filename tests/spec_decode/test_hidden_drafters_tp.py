"""EAGLE, EAGLE-3 and MTP speculation under tensor parallelism: every rank builds the drafter
sharded like the target (its attention heads and caches in the rank's share of the pool, its
``fc`` and norms replicated), drafts and verdicts are rank 0's, and the tokens sampled after
a step reach every rank's drafter (it reads them as its next inputs).

A TP=2 engine gives TP=1's tokens with the same drafter: seeded sampling at temperature 0.8
(the emitted tokens depend on every draft and its distribution, so any rank drafting other
tokens, or a head fed other inputs, changes them), then greedy (TP=1 without speculation),
then the same prompts again (prefix hits); on a dense target (Qwen3, EAGLE) and a Gated
DeltaNet hybrid (Qwen3.5, EAGLE-3 with a draft vocabulary and MTP). Random heads: part of
the drafts are accepted at temperature 0.8.
"""

from __future__ import annotations

import shutil

import pytest

from pagefold import LLM, SamplingParams
from pagefold.testing import tiny_models
from pagefold.testing.spec_models import add_mtp_weights, write_eagle_head

K = 2
NEW = 8
KW = {"max_model_len": 96, "max_num_batched_tokens": 13, "kv_cache_memory": 4 << 20}


def _gen(llm: LLM, prompts, temperature: float):
    params = [SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=temperature,
                             seed=i if temperature else None) for i in range(len(prompts))]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch, method", [("qwen3", "eagle"), ("qwen3_5", "eagle3"),
                                          ("qwen3_5", "mtp")])
def test_hidden_state_drafters_under_tp2_equal_tp1(tiny_model_factory, tmp_path, arch: str,
                                                   method: str) -> None:
    target = tiny_model_factory(arch)
    if method == "mtp":
        target = add_mtp_weights(shutil.copytree(target, tmp_path / "target"), seed=2)
        spec = {"method": "mtp"}
    else:
        head = write_eagle_head(target, tmp_path / "head", method, seed=3,
                                draft_vocab=300 if method == "eagle3" else None)
        spec = {"method": method, "model": str(head)}
    spec |= {"num_speculative_tokens": K, "disable_by_batch_size": 64}
    prompts = tiny_models.random_prompts(4, 5, 40, 512, seed=11)
    want = _ids(_gen(LLM(str(target), **KW), prompts, 0.0))
    want_sampled = _ids(_gen(LLM(str(target), speculative_config=spec, **KW), prompts, 0.8))
    llm = LLM(str(target), tensor_parallel_size=2, threads_per_rank=1, speculative_config=spec,
              **KW)
    try:
        prefix = "mtp." if method == "mtp" else "eagle."
        assert any(n.startswith(prefix) for g in llm.engine.kv_config.groups
                   for n in g.layer_names)
        # First (a fresh engine, as TP=1's): each request's draws depend on the steps it ran.
        assert _ids(_gen(llm, prompts, 0.8)) == want_sampled
        m = llm.engine.spec.metrics
        assert 0 < m.num_accepted_tokens < m.num_draft_tokens, m.summary()
        assert _ids(_gen(llm, prompts, 0.0)) == want
        again = _gen(llm, prompts, 0.0)
        assert _ids(again) == want and sum(o.num_cached_tokens for o in again) > 0
        llm.engine.kv.check_whole()
    finally:
        llm.engine.shutdown()


def test_an_eagle_head_that_does_not_split_is_refused(tiny_model_factory, tmp_path) -> None:
    """Under TP the head is sharded like the target: its heads must divide by the ranks."""
    target = tiny_model_factory("qwen3")
    head = write_eagle_head(target, tmp_path / "head", "eagle")
    cfg = head / "config.json"
    cfg.write_text(cfg.read_text().replace('"num_attention_heads": 4', '"num_attention_heads": 1')
                   .replace('"num_key_value_heads": 2', '"num_key_value_heads": 1'))
    with pytest.raises(ValueError, match=r"num_attention_heads \(1\) is not divisible by "
                                         r"tensor_parallel_size 2"):
        LLM(str(target), tensor_parallel_size=2, **KW,
            speculative_config={"method": "eagle", "model": str(head),
                                "num_speculative_tokens": 2})
