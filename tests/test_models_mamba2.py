"""Mamba-2 hybrids end to end against transformers: Nemotron-H, Granite 4.0-H (MoE), Bamba.

Every scenario runs 16 prompts of 5..80 tokens together, greedy, float32, and compares the
tokens with ``hf_greedy``: an ample pool, chunked prefill at 7 and 33 tokens per step (prefill
chunks mixed with decodes, conv and SSM states handed across chunks), and a pool so small that
requests are preempted and recomputed. Logprobs (step 0's top 5, every chosen token) are
compared with one teacher-forced ``hf_logprobs`` pass per prompt.

transformers' single-token decode step does not clamp dt while its prompt pass does; for
a model whose clamp has a positive minimum (Nemotron-H's ``time_step_limit``; before
transformers 5.25 its ``time_step_min``) a teacher-forced pass therefore differs slightly from
what ``generate`` computed, so a dedicated test compares against ``generate``'s own logits
on a model where the clamp matters. Granite's router can flip on a near tie between two float32
implementations, so there the comparison stops at the first divergence after checking that each
side's token is in the other's top 5.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagefold import LLM, SamplingParams
from pagefold.executor.forward_context import StateMetadata
from pagefold.models.mamba2_hybrid import _clamped_token_mask
from pagefold.models.weights import iter_weights
from pagefold.testing.oracle import hf_greedy, hf_logprobs, load_hf_model

N_PROMPTS, MIN_LEN, MAX_LEN, N_NEW, VOCAB = 16, 5, 80, 10, 512
MAX_MODEL_LEN = MAX_LEN + N_NEW
TOP = 5
LOGPROB_ATOL = 1e-4
PAGE = 4096  # bytes of one cache page for these tiny configs (float32)

# The small pools hold one request of MAX_MODEL_LEN as the engine counts it (state pages of
# every Mamba layer plus attention pages) and little more, so with 16 requests in flight and
# chunked prefill, running requests outgrow the pool and get preempted.
SMALL_POOL = {"nemotron_h": 20 * PAGE, "granite": 26 * PAGE, "bamba": 26 * PAGE}
SCENARIOS = {
    "ample": dict(kv_cache_memory=4 << 20),
    "chunk7": dict(kv_cache_memory=4 << 20, max_num_batched_tokens=7),
    "chunk33": dict(kv_cache_memory=4 << 20, max_num_batched_tokens=33),
    "preempt": dict(max_num_batched_tokens=33),
}
FIXTURES = {"nemotron_h": "nemotron_h_dir", "granite": "granite_hybrid_dir",
            "bamba": "bamba_dir"}

def _prompts(random_prompts) -> list[list[int]]:
    return random_prompts(N_PROMPTS, MIN_LEN, MAX_LEN, VOCAB, seed=11)


def _generate(model_dir: Path, prompts: list[list[int]], **engine_kw):
    llm = LLM(str(model_dir), max_model_len=MAX_MODEL_LEN, **engine_kw)
    params = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs], llm


def _teacher_forced(model_dir: Path, prompt: list[int], out) -> list[dict[int, float]]:
    """HF's top-5 rows for every generated step, from one pass over prompt + pagefold's tokens
    (row i predicts token i; rows up to a divergence are what ``generate`` saw, up to dt)."""
    seq = prompt + list(out.token_ids[: N_NEW - 1])
    return hf_logprobs(model_dir, seq, TOP)[len(prompt) - 1 :]


def _check_logprobs(ref: list[dict[int, float]], out, n: int, atol: float) -> None:
    """Step 0's top 5 (ids and logprobs) and the first ``n`` chosen tokens' logprobs match."""
    if n == 0:
        return
    first = out.logprobs[0]
    for tok, lp in ref[0].items():
        assert tok in first, f"HF top-{TOP} token {tok} missing from pagefold's top {TOP}"
        assert first[tok].logprob == pytest.approx(lp, abs=LOGPROB_ATOL)
    for i in range(n):
        tok = out.token_ids[i]
        assert tok in ref[i], f"step {i}: token {tok} not in HF's top {TOP}"
        assert out.logprobs[i][tok].logprob == pytest.approx(ref[i][tok], abs=atol), f"step {i}"


def _finish(llm: LLM, scenario: str) -> None:
    llm.engine.kv.check_whole()
    if scenario == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0


def _run(request, arch: str, scenario: str, random_prompts):
    model_dir = request.getfixturevalue(FIXTURES[arch])
    prompts = _prompts(random_prompts)
    ref = hf_greedy(model_dir, prompts, N_NEW)
    kw = dict(SCENARIOS[scenario])
    kw.setdefault("kv_cache_memory", SMALL_POOL[arch])
    outs, llm = _generate(model_dir, prompts, **kw)
    return model_dir, prompts, ref, outs, llm


# Nemotron-H's generated tokens skip the dt clamp in transformers' decode path, which a
# teacher-forced pass applies: their logprobs agree only to ~5e-5 for this model (exactness is
# checked against ``generate`` itself in test_nemotron_h_decode_dt_matches_hf_generate).
DECODE_ATOL = {"nemotron_h": 5e-4, "bamba": LOGPROB_ATOL}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("arch", ["nemotron_h", "bamba"])
def test_exact_models_match_hf(request, random_prompts, arch: str, scenario: str) -> None:
    model_dir, prompts, ref, outs, llm = _run(request, arch, scenario, random_prompts)
    assert [list(o.token_ids) for o in outs] == ref
    for p, o in zip(prompts, outs, strict=True):
        _check_logprobs(_teacher_forced(model_dir, p, o), o, N_NEW, DECODE_ATOL[arch])
    _finish(llm, scenario)


def _check_moe_outputs(model_dir: Path, prompts, outs, ref, atol: float = LOGPROB_ATOL) -> None:
    """Tokens equal HF's up to a near-tie routing flip, where each side's token must be in the
    other's top 5; logprobs are compared up to there. At most 2 of the prompts may flip."""
    exact = 0
    for p, o, r in zip(prompts, outs, ref, strict=True):
        got = list(o.token_ids)
        tf = _teacher_forced(model_dir, p, o)
        d = next((i for i, (a, b) in enumerate(zip(got, r)) if a != b), None)
        if d is None:
            exact += 1
            d = N_NEW
        else:
            assert got[d] in tf[d], f"pagefold token {got[d]} not in HF's top {TOP} at {d}"
            assert r[d] in o.logprobs[d], f"HF token {r[d]} not in pagefold's top {TOP} at {d}"
        _check_logprobs(tf, o, d, atol)
    # A flip is rare; most sequences must agree exactly or the rule would hide a real bug.
    assert exact >= len(prompts) - 2


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_granite_matches_hf(request, random_prompts, scenario: str) -> None:
    model_dir, prompts, ref, outs, llm = _run(request, "granite", scenario, random_prompts)
    _check_moe_outputs(model_dir, prompts, outs, ref)
    _finish(llm, scenario)


def test_nemotron_h_moe_matches_hf(tiny_model_factory, random_prompts, tmp_path: Path) -> None:
    """Nemotron-H MoE blocks ("E"): sigmoid router with score-correction bias and group-limited
    top-k (2 groups of 4 experts, 1 group kept), routed scaling, latent expert projections and
    a shared expert; the correction bias is made non-zero so it changes the choice."""
    src = tiny_model_factory(
        "nemotron_h",
        layers_block_type=["linear_attention", "moe", "full_attention", "moe",
                           "linear_attention", "mlp"],
        n_routed_experts=8, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
        num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=1.5,
        moe_latent_size=24,
    )
    model_dir = tmp_path / "nemotron_h_moe"
    shutil.copytree(src, model_dir)
    weights = load_file(model_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name in weights:
        if name.endswith("e_score_correction_bias"):
            weights[name] = 0.3 * torch.randn(weights[name].shape, generator=gen)
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    prompts = random_prompts(8, MIN_LEN, MAX_LEN, VOCAB, seed=5)
    ref = hf_greedy(model_dir, prompts, N_NEW)
    outs, llm = _generate(model_dir, prompts, kv_cache_memory=4 << 20, max_num_batched_tokens=33)
    _check_moe_outputs(model_dir, prompts, outs, ref, atol=DECODE_ATOL["nemotron_h"])
    llm.engine.kv.check_whole()


def _hf_generate_logprobs(model_dir: Path, prompt: list[int], n: int):
    """Tokens and per-step log-softmax rows of transformers' own greedy ``generate`` (its
    prompt pass, then one single-token decode step per token: the path being mirrored)."""
    model = load_hf_model(model_dir)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=None)
    rows = [torch.log_softmax(x[0].float(), -1) for x in out.logits]
    return out.sequences[0, len(prompt) :].tolist(), rows


def _staggered(llm: LLM, prompts: list[list[int]], params: SamplingParams, gap: int):
    """Add one request every ``gap`` steps, so each new prompt (one whole chunk) shares its
    step with single-token decodes of the requests already running; then drain."""
    ids, final = [], {}
    for p in prompts:
        ids.append(llm.add_request({"prompt_token_ids": p}, params))
        for _ in range(gap):
            final.update({o.request_id: o for o in llm.step() if o.finished})
    while len(final) < len(ids):
        final.update({o.request_id: o for o in llm.step() if o.finished})
    return [final[i].outputs[0] for i in ids]


@pytest.mark.parametrize("mixed", [False, True])
def test_nemotron_h_decode_dt_matches_hf_generate(tiny_model_factory, random_prompts,
                                                   mixed: bool) -> None:
    """With a large ``time_step_min`` the dt clamp shows in the logprobs (~4e-3 when decode
    tokens are clamped too); every step's logprobs must equal what transformers' ``generate``
    computed (prompt clamped, decode steps not), both in all-decode steps and in steps where
    decodes share the chunked kernel with a new prompt."""
    # transformers >= 5.25 clamps the prompt's dt at time_step_limit, earlier ones at
    # time_step_min: set both.
    model_dir = tiny_model_factory("nemotron_h", time_step_min=0.05,
                                   time_step_limit=[0.05, math.inf])
    prompts = random_prompts(4, 20, 60, VOCAB, seed=3)
    params = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=TOP)
    llm = LLM(str(model_dir), max_model_len=MAX_MODEL_LEN, kv_cache_memory=4 << 20)
    if mixed:
        outs = _staggered(llm, prompts, params, gap=2)
    else:
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                   params, use_tqdm=False)]
    for p, o in zip(prompts, outs, strict=True):
        toks, rows = _hf_generate_logprobs(model_dir, p, N_NEW)
        assert list(o.token_ids) == toks
        for i, t in enumerate(toks):
            assert o.logprobs[i][t].logprob == pytest.approx(float(rows[i][t]),
                                                             abs=LOGPROB_ATOL), f"step {i}"
    llm.engine.kv.check_whole()


def _load(model_dir: Path, weights):
    from transformers import AutoConfig

    from pagefold.architectures import resolve_architecture
    from pagefold.checkpoint import read_config_dict
    from pagefold.models.registry import model_class

    cls = model_class(resolve_architecture(read_config_dict(model_dir)))
    model = cls(AutoConfig.from_pretrained(str(model_dir)), max_positions=128)
    model.load_weights(weights)
    return model.state_dict()


def _in_memory_names(name: str, tensor: torch.Tensor, stacked: dict[str, list]):
    """transformers' in-memory names: ``model.`` for Nemotron-H's ``backbone.``, stacked
    ``experts.{up,down}_proj``, Granite's ``experts.gate_up_proj`` / ``router.weight``."""
    name = name.replace("backbone.", "model.")
    name = name.replace("block_sparse_moe.input_linear.weight",
                        "block_sparse_moe.experts.gate_up_proj")
    name = name.replace("block_sparse_moe.output_linear.weight",
                        "block_sparse_moe.experts.down_proj")
    name = name.replace("router.layer.weight", "router.weight")
    parts = name.split(".")
    if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
        i = parts.index("experts")
        key = ".".join(parts[: i + 1] + [parts[i + 2]])
        stacked.setdefault(key, []).append((int(parts[i + 1]), tensor))
        return None
    return name


@pytest.mark.parametrize("arch", ["nemotron_h_moe", "granite"])
def test_loads_transformers_in_memory_names(tiny_model_factory, granite_hybrid_dir,
                                            arch: str) -> None:
    if arch == "granite":
        model_dir = granite_hybrid_dir
    else:
        model_dir = tiny_model_factory("nemotron_h", layers_block_type=["linear_attention", "moe"],
                                       n_routed_experts=4, moe_intermediate_size=16,
                                       moe_shared_expert_intermediate_size=16)
    original = list(iter_weights(model_dir))
    stacked: dict[str, list] = {}
    renamed = [(n2, t) for n, t in original if (n2 := _in_memory_names(n, t, stacked))]
    for key, parts in stacked.items():
        renamed.append((key, torch.stack([t for _, t in sorted(parts, key=lambda x: x[0])])))
    assert {n for n, _ in renamed} != {n for n, _ in original}
    want, got = _load(model_dir, original), _load(model_dir, renamed)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k


def test_decode_tokens_skip_dt_clamp() -> None:
    """Only single-token steps of requests that already have a state skip the dt clamp (the
    transformers decode path); prompt chunks, including one-token chunks, are clamped."""
    cu = torch.tensor([0, 1, 4, 5, 6])
    meta = StateMetadata(page_ids=torch.zeros(4, 1, dtype=torch.long), cu_seqlens=cu,
                         has_initial_state=torch.tensor([True, True, False, True]),
                         all_decode=False, any_initial_state=True)
    mask = _clamped_token_mask(meta, 6, torch.device("cpu"))
    assert mask.tolist() == [False, True, True, True, True, False]
