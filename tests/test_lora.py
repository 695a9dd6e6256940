"""Multi-LoRA serving: one batch mixing three PEFT adapters and the base model gives, per row,
the greedy tokens of transformers + peft with that adapter (float32); the prefix cache is
keyed by adapter; bad adapters are clear errors; the compiled kernels equal the torch form.

The oracle (``pagefold.testing.lora_adapters``) is peft itself: it makes random adapters
(non-zero B, ranks 4 / 8 / 16, different target modules), saves them with
``save_pretrained`` and decodes with the wrapped transformers model.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pagefold import LLM, LoRARequest, SamplingParams
from pagefold.distributed.parallel_state import set_tensor_parallel
from pagefold.layers.linear import load_into
from pagefold.layers.lora_linear import LoRALinear, LoRAStep
from pagefold.lora.layout import lora_layout
from pagefold.lora.request import LoRARequest as LoRARequestFromPackage
from pagefold.models.granite_hybrid import GraniteSharedMLP
from pagefold.ops.lora import cpu as lora_cpu
from pagefold.ops.lora import reference as lora_ref
from pagefold.testing.lora_adapters import make_adapter, peft_greedy

# Not imported here: peft pulls in triton at collection, before the Triton tests set
# TRITON_INTERPRET (their kernels would then fail under the interpreter).
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                reason="peft not installed")

NEW = 5
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
RANKS = (4, 8, 16)
TARGETS = {
    "llama": [["q_proj", "v_proj"], ["o_proj", "down_proj"], ["gate_proj", "up_proj", "k_proj"]],
    "qwen3_5": [["in_proj_qkv", "out_proj"], ["q_proj", "v_proj", "in_proj_z"],
                ["gate_proj", "down_proj", "in_proj_a", "in_proj_b"]],
    # Qwen3-Next: the checkpoint's in_proj_qkvz / in_proj_ba rows are regrouped at load time;
    # their B rows are regrouped alike.
    "qwen3_next": [["in_proj_qkvz", "out_proj"], ["in_proj_ba", "q_proj"],
                   ["in_proj_qkvz", "in_proj_ba", "o_proj"]],
    "bamba": [["in_proj", "out_proj"], ["q_proj", "o_proj"], ["gate_proj", "up_proj",
                                                             "down_proj"]],
    # Nemotron-H: PEFT saves ``model.layers.*`` (transformers' name), the checkpoint and
    # pagefold say ``backbone.layers.*``; PEFT refuses its Mamba out_proj.
    "nemotron_h": [["in_proj", "q_proj"], ["o_proj", "up_proj"], ["in_proj", "down_proj",
                                                                  "k_proj"]],
}
PROMPTS = [[5, 17, 42, 9, 77, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [100, 200, 300],
           [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]]


@pytest.fixture(scope="module")
def adapters(tiny_model_factory, tmp_path_factory):
    """arch -> (base dir, [adapter dirs]) built once per module."""
    root = tmp_path_factory.mktemp("lora")
    made = {}

    def get(arch: str):
        if arch not in made:
            base = tiny_model_factory(arch)
            made[arch] = (base, [make_adapter(base, root / f"{arch}-{i}", rank=r,
                                              target_modules=t, seed=10 + i)
                                 for i, (r, t) in enumerate(zip(RANKS, TARGETS[arch]))])
        return made[arch]

    return get


def _requests(dirs) -> list[LoRARequest]:
    return [LoRARequest(f"adapter{i}", i + 1, str(d)) for i, d in enumerate(dirs)]


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_lora_request_names():
    assert LoRARequest is LoRARequestFromPackage
    r = LoRARequest("a", 3, "/x")
    assert (r.name, r.id, r.path) == ("a", 3, "/x")
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/x")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernels_equal_torch_form(dtype):
    if lora_cpu.kernels() is None:
        pytest.skip("no compiled CPU kernels")
    g = torch.Generator().manual_seed(0)
    rows, k, r, o, slots = 13, 40, 24, 300, 3  # o: more than one block of outputs
    x = torch.randn(rows, k, generator=g).to(dtype)
    a = torch.randn(slots, r, k, generator=g).to(dtype)
    b = torch.randn(slots, r, o, generator=g).to(dtype)
    idx = torch.tensor([0, -1, 2, 2, 1, -1, 0, 0, 1, 2, -1, -1, 1])
    # The plain per-row definition.
    want_v = torch.stack([x[i].float() @ a[s].float().T if s >= 0 else torch.zeros(r)
                          for i, s in enumerate(idx.tolist())])
    v_ref = lora_ref.shrink(x, a, idx)
    v = lora_cpu.shrink(x, a, idx)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(v_ref, want_v, rtol=tol, atol=tol)
    torch.testing.assert_close(v, want_v, rtol=tol, atol=tol)
    y0 = torch.randn(rows, o, generator=g).to(dtype)
    y_ref, y = y0.clone(), y0.clone()
    lora_ref.expand_(y_ref, v, b, idx)
    assert lora_cpu.expand_(y, v, b, idx)
    base = idx < 0
    assert torch.equal(y[base], y0[base]) and torch.equal(y_ref[base], y0[base])
    want_y = y0.float() + torch.stack([v[i] @ b[s].float() if s >= 0 else torch.zeros(o)
                                       for i, s in enumerate(idx.tolist())])
    torch.testing.assert_close(y.float(), want_y, rtol=tol, atol=tol * 10)
    torch.testing.assert_close(y_ref.float(), want_y, rtol=tol, atol=tol * 10)
    assert not torch.equal(y[~base], y0[~base])


@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "qwen3_next", "bamba", "nemotron_h"])
def test_mixed_batch_matches_peft(adapters, arch):
    base, dirs = adapters(arch)
    loras = [None, *_requests(dirs)]
    want = [peft_greedy(d, base, [p], NEW)[0] for d, p in zip([None, *dirs], PROMPTS)]
    base_only = [peft_greedy(None, base, [p], NEW)[0] for p in PROMPTS[1:]]
    assert sum(w != b for w, b in zip(want[1:], base_only)) >= 2  # the adapters matter
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16,
              kv_cache_memory=1 << 23, max_num_batched_tokens=23, warm_up=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                        lora_request=loras, use_tqdm=False)
    assert _ids(outs) == want
    llm.engine.kv.check_whole()
    # Every adapter became resident once: the four requests ran as one batch.
    assert llm.engine.runner.lora.loads == 3


def test_one_slot_swaps_adapters_and_stays_exact(adapters):
    base, dirs = adapters("llama")
    loras = [None, *_requests(dirs)]
    want = [peft_greedy(d, base, [p], NEW)[0] for d, p in zip([None, *dirs], PROMPTS)]
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=16,
              kv_cache_memory=1 << 23, warm_up=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                        lora_request=loras, use_tqdm=False)
    assert _ids(outs) == want
    assert llm.engine.runner.lora.loads == 3  # one slot, rewritten per adapter
    # Removing an adapter frees its slot and host copy; asking again reads it again.
    llm.engine.remove_lora(3)
    assert 3 not in llm.engine.runner.lora.resident and 3 not in llm.engine.loras.entries
    again = llm.generate([{"prompt_token_ids": PROMPTS[3]}], GREEDY, lora_request=loras[3],
                         use_tqdm=False)
    assert _ids(again) == want[3:] and llm.engine.runner.lora.loads == 4
    llm.engine.kv.check_whole()


def test_prefix_cache_keyed_by_adapter(adapters):
    """The same prompt under the base model and two adapters: hits only within an adapter,
    tokens always the adapter's (a GDN hybrid: blocks and state checkpoints alike)."""
    base, dirs = adapters("qwen3_5")
    prompt = [(7 * i + 3) % 500 for i in range(40)]
    loras = [None, *_requests(dirs[:2])]
    want = [peft_greedy(d, base, [prompt], NEW)[0] for d in [None, *dirs[:2]]]
    assert len({tuple(w) for w in want}) == 3
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              kv_cache_memory=1 << 24, warm_up=False)
    for rnd in range(2):
        for lora, w in zip(loras, want):
            out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, lora_request=lora,
                               use_tqdm=False)[0]
            assert out.outputs[0].token_ids == w
            # First round: nothing cached for this adapter yet (others' entries never hit);
            # second round: its own prefix, up to the last full block.
            assert out.num_cached_tokens == (0 if rnd == 0 else 32)
            llm.engine.kv.check_whole()


def test_errors_name_the_problem(adapters, tiny_model_factory, tmp_path):
    base, dirs = adapters("llama")
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              kv_cache_memory=1 << 22, warm_up=False)
    prompt = [{"prompt_token_ids": PROMPTS[0]}]
    with pytest.raises(ValueError, match=r"adapter2.*rank 16, above max_lora_rank 8"):
        llm.generate(prompt, GREEDY, lora_request=LoRARequest("adapter2", 3, str(dirs[2])))
    unknown = tmp_path / "unknown"
    shutil.copytree(dirs[0], unknown)
    cfg = json.loads((unknown / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "v_proj", "mystery_proj"]
    (unknown / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unknown target modules \['mystery_proj'\]"):
        llm.generate(prompt, GREEDY, lora_request=LoRARequest("u", 4, str(unknown)))
    other = tiny_model_factory("qwen3")  # head_dim 32: q_proj has 128 outputs, llama's 64
    wrong = make_adapter(other, tmp_path / "wrong", rank=4, target_modules=["q_proj"], seed=1)
    with pytest.raises(ValueError, match=r"'w' does not fit the base model.*q_proj"):
        llm.generate(prompt, GREEDY, lora_request=LoRARequest("w", 5, str(wrong)))
    with pytest.raises(ValueError, match="not a PEFT adapter directory"):
        llm.generate(prompt, GREEDY, lora_request=LoRARequest("m", 6, str(tmp_path / "none")))
    llm.engine.kv.check_whole()
    assert not llm.engine.scheduler.has_unfinished()  # nothing of a refused batch queued
    off = LLM(str(base), dtype="float32", kv_cache_memory=1 << 22, warm_up=False)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        off.generate(prompt, GREEDY, lora_request=LoRARequest("adapter0", 1, str(dirs[0])))


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_tp2_mixed_batch_matches_peft(adapters, arch):
    """Column-parallel parts (GDN's q | k | v blocks cut one by one) and row-parallel layers
    (A cut on the input, the shrink all-reduced)."""
    base, dirs = adapters(arch)
    loras = [None, *_requests(dirs)]
    want = [peft_greedy(d, base, [p], NEW)[0] for d, p in zip([None, *dirs], PROMPTS)]
    llm = LLM(str(base), dtype="float32", tensor_parallel_size=2, enable_lora=True,
              max_loras=3, max_lora_rank=16, kv_cache_memory=1 << 22, threads_per_rank=1,
              warm_up=False)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                            lora_request=loras, use_tqdm=False)
        assert _ids(outs) == want
        llm.engine.kv.check_whole()
    finally:
        llm.engine.shutdown()


def test_bf16_base_rows_keep_their_bits(adapters):
    """bf16 (the native decode driver's dtype): with LoRA enabled, a batch without adapters
    gives the LoRA-off engine's tokens and logprobs bit for bit; in a mixed batch (module
    path) the base rows keep their tokens."""
    base, dirs = adapters("llama")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    sp = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0)

    def lps(outs):
        return [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in outs]

    off = LLM(str(base), dtype="bfloat16", kv_cache_memory=1 << 22, warm_up=False)
    want = off.generate(prompts, sp, use_tqdm=False)
    on = LLM(str(base), dtype="bfloat16", enable_lora=True, max_loras=2, max_lora_rank=16,
             kv_cache_memory=1 << 22, warm_up=False)
    plain = on.generate(prompts, sp, use_tqdm=False)
    assert _ids(plain) == _ids(want) and lps(plain) == lps(want)
    reqs = _requests(dirs)
    mixed = on.generate(prompts, sp, lora_request=[None, reqs[0], None, reqs[2]],
                        use_tqdm=False)
    got = _ids(mixed)
    assert [got[0], got[2]] == [_ids(want)[0], _ids(want)[2]]
    assert got[1] != _ids(want)[1] or got[3] != _ids(want)[3]
    on.engine.kv.check_whole()


def test_preemption_and_odd_chunks_stay_exact(adapters):
    """A pool of 8 blocks for 6 requests over 2 adapter slots: requests are preempted and
    recomputed, chunks are 19 tokens, adapters move between slots; every row stays exact."""
    base, dirs = adapters("llama")
    reqs = _requests(dirs)
    prompts = [[(13 * i + 7 * j) % 500 + 3 for j in range(30 + 5 * i)] for i in range(6)]
    loras = [None if i % 4 == 0 else reqs[i % 4 - 1] for i in range(6)]
    want = [peft_greedy(None if r is None else dirs[r.lora_int_id - 1], base, [p], 8)[0]
            for r, p in zip(loras, prompts)]
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              kv_cache_memory=80000, max_num_batched_tokens=19, max_model_len=128,
              warm_up=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                        lora_request=loras, use_tqdm=False)
    assert _ids(outs) == want
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.runner.lora.loads > 3
    llm.engine.kv.check_whole()


def test_granite_shared_mlp_adapter_cut_as_its_gate_up_rows():
    """Granite-4.0-H's shared MLP (``input_linear``: gate | up rows cut by the model's own
    loader) under two tensor-parallel ranks, built in one process: its adapter's B is cut as
    those rows, so the ranks' partial outputs sum to the one-rank definition; base rows keep
    the plain output."""
    g = torch.Generator().manual_seed(11)
    hidden, inter, r = 16, 12, 4
    cfg = SimpleNamespace(hidden_size=hidden, shared_intermediate_size=inter, hidden_act="silu")
    w_in = torch.randn(2 * inter, hidden, generator=g) * 0.3
    w_out = torch.randn(hidden, inter, generator=g) * 0.3
    a = torch.randn(r, hidden, generator=g) * 0.4
    b = torch.randn(2 * inter, r, generator=g) * 0.4
    x = torch.randn(4, hidden, generator=g)
    idx = torch.tensor([0, -1, 0, 0])

    def mlp_out(w, rows):
        gate, up = (rows.double() @ w.double().T).split(inter, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ w_out.double().T

    want = torch.where((idx >= 0)[:, None], mlp_out(w_in + b @ a, x), mlp_out(w_in, x))
    total = torch.zeros(4, hidden, dtype=torch.float64)
    try:
        for rank in range(2):
            set_tensor_parallel(rank, 2)
            model = nn.Module()
            model.layers = nn.ModuleList([GraniteSharedMLP(cfg)])
            load_into(model.layers[0], [("input_linear.weight", w_in),
                                        ("output_linear.weight", w_out)])
            lin, lay = lora_layout(model)["layers.0.input_linear"]
            assert lay.kind == "column" and lay.parts["input_linear"].full_rows == 2 * inter
            LoRALinear(lin, lay, LoRAStep(idx=idx), num_slots=1, max_rank=r).set_part(
                0, "input_linear", a, b)
            total += model.layers[0](x).double()
    finally:
        set_tensor_parallel(0, 1)
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)
