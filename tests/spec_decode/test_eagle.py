"""EAGLE and EAGLE-3 speculation (random heads written in the public checkpoints' layout):

* greedy float32 tokens with the head drafting equal transformers' (= speculation off) on a
  dense (Llama) and a GDN hybrid (Qwen3.5) target, under batching with chunked prefill at an
  odd size plus prefix-cache hits, and under preemption;
* the drafts the engine proposes equal an independent torch implementation of the head run on
  transformers' hidden states (the target's output for EAGLE, the inputs of three layers for
  EAGLE-3, the draft vocabulary mapped through ``d2t``);
* a head built to copy the target (a target whose attention output is zero is a function of
  the current token alone, which a one-layer EAGLE head can reproduce exactly) has almost
  every draft accepted, and a noisy copy accepts some: every accepted length is exercised.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagefold import LLM, SamplingParams
from pagefold.testing import tiny_models
from pagefold.testing.oracle import hf_greedy
from pagefold.testing.spec_models import write_eagle_head
from tests.spec_decode.eagle_reference import check_drafts, record_drafts

K = 3
NEW = 10
DRAFT_VOCAB = 300  # EAGLE-3: a draft vocabulary smaller than the target's 512 (d2t mapping)
CASES = [("llama", "eagle"), ("llama", "eagle3"), ("qwen3_5", "eagle"), ("qwen3_5", "eagle3")]
SMALL_POOL = {"llama": 120_000, "qwen3_5": 200_000}


def _spec(method: str, head) -> dict:
    return {"method": method, "model": str(head), "num_speculative_tokens": K,
            "disable_by_batch_size": 64}


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def case(request, tiny_model_factory, tmp_path_factory):
    arch, method = request.param
    target = tiny_model_factory(arch)
    head = write_eagle_head(target, tmp_path_factory.mktemp("eagle") / f"{arch}-{method}",
                            method, seed=3,
                            draft_vocab=DRAFT_VOCAB if method == "eagle3" else None)
    prompts = tiny_models.random_prompts(5, 5, 40, 512, seed=13)
    return arch, method, target, head, prompts, hf_greedy(target, prompts, NEW)


def _gen(llm: LLM, prompts) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    return [o.outputs[0].token_ids
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                  use_tqdm=False)]


def _check_drafts(case, seen) -> int:
    arch, method, target, head, prompts, ref = case
    return check_drafts(target, head, method, [p + r for p, r in zip(prompts, ref)], seen)


@pytest.mark.parametrize("scenario", ["chunk7_prefix", "preempt"])
def test_greedy_with_eagle_equals_transformers(case, scenario: str) -> None:
    """Tokens equal transformers'; every round's drafts equal the independent head's (the
    head's KV rows are the target's positions with the next tokens -- also when cached by a
    prefix hit, swapped out and back, or computed in 7-token chunks --, chained drafts feed
    the head's own output back, EAGLE-3 reads layers (2, n // 2, n - 3) clamped to the
    target and maps its draft vocabulary through d2t)."""
    arch, method, target, head, prompts, ref = case
    kw: dict = {"max_model_len": 96}
    if scenario == "chunk7_prefix":
        kw["max_num_batched_tokens"] = 7
    else:
        kw |= {"kv_cache_memory": SMALL_POOL[arch], "preemption_mode": "auto",
               "swap_space": "8MiB", "max_num_batched_tokens": 29}
    llm = LLM(str(target), speculative_config=_spec(method, head), **kw)
    assert "eagle.layers.0" in {n for g in llm.engine.kv_config.groups for n in g.layer_names}
    seen = record_drafts(llm)
    assert _gen(llm, prompts) == ref
    if scenario == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    else:  # the same prompts again: prefix hits (the head's KV is cached with the target's)
        sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
        again = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == ref
        assert sum(o.num_cached_tokens for o in again) > 0
    assert _check_drafts(case, seen) >= 8
    llm.engine.kv.check_whole()


# --- a head that copies the target ---------------------------------------------------------


@pytest.fixture(scope="module")
def unigram_target(tiny_model_factory, tmp_path_factory):
    """A one-layer Llama whose attention output is zero (each next token a function of the
    current token alone) and whose final norm is uniform (so ``lm_head(x)`` and
    ``lm_head(norm(x))`` share their argmax)."""
    src = tiny_model_factory("llama", num_hidden_layers=1)
    dst = tmp_path_factory.mktemp("unigram") / "llama-1"
    shutil.copytree(src, dst)
    w = load_file(str(dst / "model.safetensors"))
    w["model.layers.0.self_attn.o_proj.weight"].zero_()
    w["model.norm.weight"].fill_(1.0)
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst, w


def _copy_head(target, w: dict, dst, noise: float):
    """EAGLE head: ``fc = [I | 0]`` keeps the next token's embedding, layer 0 is the target's
    layer 0 (plus ``noise`` times each MLP weight's std)."""
    g = torch.Generator().manual_seed(7)
    h = w["model.embed_tokens.weight"].shape[1]
    over = {"fc.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], 1)}
    for name, t in w.items():
        if name.startswith("model.layers.0.") and "input_layernorm" not in name:
            t = t.clone()
            if noise and ".mlp." in name:
                t += noise * float(t.std()) * torch.randn(t.shape, generator=g)
            over[name.removeprefix("model.")] = t
    return write_eagle_head(target, dst, "eagle", tensors=over,
                            intermediate_size=w["model.layers.0.mlp.up_proj.weight"].shape[0])


@pytest.mark.parametrize("noise", [0.0, 0.15])
def test_a_head_copying_the_target_is_accepted(unigram_target, tmp_path, noise) -> None:
    target, w = unigram_target
    head = _copy_head(target, w, tmp_path / "head", noise)
    prompts = tiny_models.random_prompts(4, 5, 30, 512, seed=21)
    ref = hf_greedy(target, prompts, NEW)
    llm = LLM(str(target), max_model_len=96, max_num_batched_tokens=7,
              speculative_config=_spec("eagle", head))
    llm.engine.spec.MAX_BACKOFF = 1
    assert _gen(llm, prompts) == ref
    m = llm.engine.spec.metrics
    if noise == 0.0:
        assert m.num_draft_tokens >= 10 and m.acceptance_rate >= 0.95, m.summary()
    else:  # partial acceptance: every accepted length occurs
        assert 0 < m.num_accepted_tokens < m.num_draft_tokens, m.summary()
        assert m.accepted_per_pos[0] > m.accepted_per_pos[K - 1] > 0, m.accepted_per_pos
