"""Draft-model speculation under tensor parallelism: a TP=2 target with its draft model sharded
the same way (each rank holds its shard of the draft and of the draft's caches) gives the
greedy tokens of TP=1 without speculation, on a dense (Qwen3) and a Gated DeltaNet hybrid
(Qwen3.5) target, with a 13-token budget (chunked prefill, batching) and a second pass over the
same prompts (prefix hits); seeded sampling gives TP=1's tokens (every rank drafts and verifies
the same tokens); the draft partly accepted, the pool whole afterwards.
"""

from __future__ import annotations

import pytest

from pagefold import LLM, SamplingParams
from pagefold.testing import tiny_models
from pagefold.testing.spec_models import perturbed_copy

K = 3
NEW = 10
NOISE = {"qwen3": 0.1, "qwen3_5": 0.01}  # partial acceptance (as test_draft_model.py)


def _gen(llm: LLM, prompts, **kw) -> list[list[int]]:
    params = [SamplingParams(max_tokens=NEW, ignore_eos=True, **kw) for _ in prompts]
    if kw.get("temperature"):
        params = [SamplingParams(max_tokens=NEW, ignore_eos=True, seed=i, **kw)
                  for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_draft_model_under_tp2_equals_tp1(tiny_model_factory, tmp_path, arch: str) -> None:
    target = tiny_model_factory(arch)
    draft = perturbed_copy(target, tmp_path / "draft", NOISE[arch], seed=1)
    prompts = tiny_models.random_prompts(4, 5, 40, 512, seed=11)
    spec = {"model": str(draft), "num_speculative_tokens": K, "disable_by_batch_size": 64}
    one = LLM(str(target), max_model_len=96, max_num_batched_tokens=13)
    want = _gen(one, prompts, temperature=0)
    one_spec = LLM(str(target), max_model_len=96, max_num_batched_tokens=13,
                   speculative_config=spec)
    want_sampled = _gen(one_spec, prompts, temperature=0.8)
    llm = LLM(str(target), tensor_parallel_size=2, max_model_len=96, max_num_batched_tokens=13,
              threads_per_rank=1, speculative_config=spec)
    try:
        assert any(n.startswith("draft.") for g in llm.engine.kv_config.groups
                   for n in g.layer_names)
        # First (a fresh engine, as TP=1's): each request's draws depend on the steps it ran.
        assert _gen(llm, prompts, temperature=0.8) == want_sampled
        assert _gen(llm, prompts, temperature=0) == want
        again = llm.generate([{"prompt_token_ids": p} for p in prompts],
                             SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0),
                             use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == want
        assert llm.engine.kv.stats.hits > 0
        m = llm.engine.spec.metrics
        assert 0 < m.num_accepted_tokens < m.num_draft_tokens, m.summary()
        llm.engine.kv.check_whole()
    finally:
        llm.engine.shutdown()
