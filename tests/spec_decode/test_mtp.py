"""MTP speculation (Qwen3.5 checkpoints with ``mtp.*`` tensors): greedy tokens with MTP drafts
equal transformers' (float32, which ignores the MTP tensors) and speculation off, under
batching, chunked prefill at an odd chunk size and preemption; clear errors for checkpoints
without MTP weights. Random MTP weights draft mostly rejected tokens: exactness, not speed,
is what these tests check (plus that MTP caches share the pool)."""

from __future__ import annotations

import shutil

import pytest

from pagefold import LLM, SamplingParams
from pagefold.testing import tiny_models
from pagefold.testing.oracle import hf_greedy
from pagefold.testing.spec_models import add_mtp_weights

NEW = 10
MTP = {"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 64}


@pytest.fixture(scope="module")
def mtp_model(tiny_model_factory, tmp_path_factory):
    src = tiny_model_factory("qwen3_5")
    dst = tmp_path_factory.mktemp("mtp") / "qwen3_5-mtp"
    shutil.copytree(src, dst)
    return add_mtp_weights(dst)


def _gen(llm: LLM, prompts, **kw):
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, **kw)
    return [o.outputs[0].token_ids
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                  use_tqdm=False)]


@pytest.mark.parametrize("kw", [{"max_num_batched_tokens": 7},
                                {"kv_cache_memory": 200_000, "preemption_mode": "auto",
                                 "swap_space": "8MiB", "max_num_batched_tokens": 29}],
                         ids=["chunk7", "preempt"])
def test_mtp_greedy_equals_transformers(mtp_model, kw) -> None:
    prompts = tiny_models.random_prompts(5, 5, 40, 512, seed=13)
    ref = hf_greedy(mtp_model, prompts, NEW)
    llm = LLM(str(mtp_model), max_model_len=96, speculative_config=MTP, **kw)
    assert any(n.startswith("mtp.") for g in llm.engine.kv_config.groups
               for n in g.layer_names)
    assert _gen(llm, prompts) == ref
    assert llm.engine.spec.metrics.num_drafts > 0
    if "kv_cache_memory" in kw:
        assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.kv.check_whole()


def test_mtp_weights_are_loaded(mtp_model) -> None:
    """The MTP block holds the checkpoint's tensors (not its random init)."""
    from safetensors.torch import load_file

    llm = LLM(str(mtp_model), max_model_len=64, speculative_config=MTP)
    mtp = llm.engine.runner.proposer.mtp
    ck = load_file(str(mtp_model / "model.safetensors"))
    assert (mtp.fc.weight == ck["mtp.fc.weight"]).all()
    assert (mtp.norm.weight == ck["mtp.norm.weight"]).all()


def test_mtp_needs_mtp_weights(tiny_model_factory, tmp_path) -> None:
    plain = tiny_model_factory("qwen3_5")
    with pytest.raises(ValueError, match="multi-token-prediction"):
        LLM(str(plain), speculative_config=MTP)  # its config declares no MTP layers
    # A config that declares MTP layers over a checkpoint without the tensors.
    import json

    dst = tmp_path / "declared"
    shutil.copytree(plain, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="lacks .* mtp"):
        LLM(str(dst), speculative_config=MTP)


def _recorded_drafts(llm: LLM, prompts, one_by_one: bool) -> dict:
    """(prompt, tokens so far) -> the drafts MTP proposed there (greedy: a function of the
    token history alone, when the MTP caches are right)."""
    prop = llm.engine.runner.proposer
    llm.engine.spec.MAX_BACKOFF = 1  # random MTP weights: keep drafting after rejections
    seen: dict = {}
    inner = prop.propose

    def propose(runner, batch, drafts):
        res = inner(runner, batch, drafts)
        for r, d, old in zip(batch.reqs, res.drafts, drafts):
            if old and old[0] < 0:
                seen[(tuple(r.prompt_token_ids), len(r.token_ids))] = tuple(d)
        return res

    prop.propose = propose
    for g in [[p] for p in prompts] if one_by_one else [prompts]:
        _gen(llm, g)
    return seen


def test_mtp_drafts_do_not_depend_on_batching(mtp_model) -> None:
    """The MTP layer's own KV cache is written for exactly the target's positions: the drafts
    made for a given token history are the same one request at a time and batched with a
    7-token budget (a wrong MTP cache row would change them)."""
    prompts = tiny_models.random_prompts(3, 5, 30, 512, seed=17)
    alone = _recorded_drafts(LLM(str(mtp_model), max_model_len=96, speculative_config=MTP),
                             prompts, True)
    batched = _recorded_drafts(LLM(str(mtp_model), max_model_len=96, max_num_batched_tokens=7,
                                   speculative_config=MTP), prompts, False)
    common = alone.keys() & batched.keys()
    assert len(common) >= 6, (len(alone), len(batched))
    for k in common:  # (a token budget may cut a round's drafts short)
        n = min(len(alone[k]), len(batched[k]))
        assert alone[k][:n] == batched[k][:n], k


@pytest.mark.slow
def test_mtp_qwen3_next(tiny_model_factory, tmp_path) -> None:
    """Qwen3-Next's MTP layer has an MoE feed-forward (stacked experts load as they are)."""
    dst = tmp_path / "qwen3_next-mtp"
    shutil.copytree(tiny_model_factory("qwen3_next"), dst)
    add_mtp_weights(dst)
    prompts = tiny_models.random_prompts(1, 5, 30, 512, seed=19)
    llm = LLM(str(dst), max_model_len=96, speculative_config=MTP)
    assert _gen(llm, prompts) == hf_greedy(dst, prompts, NEW)
    assert llm.engine.spec.metrics.num_drafts > 0
    assert (llm.engine.runner.proposer.mtp.layers[0].mlp.experts.down_proj != 0).any()
    llm.engine.kv.check_whole()
