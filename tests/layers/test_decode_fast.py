"""The fast decode paths (pagefold.layers.decode_fast, decode_fast_hybrid) give the module
path's bits: same tokens and same logprobs (bf16, greedy) for Llama (plain), Qwen2 (qkv bias),
Qwen3 (q/k norm), and the GDN hybrids Qwen3.5 (gated attention with partial RoPE, a dense MLP)
and Qwen3-Next (a sparse MoE block through its own forward), at batch 1, 2 and 3; with the
GEMV's row limit at 1, every batch above 1 takes the plan's other branch (each linear's own
forward, the GEMM library); the fast path must actually have run."""

from __future__ import annotations

import pytest

from pagefold import LLM, SamplingParams
from pagefold.csrc import cpu_ops
from pagefold.layers import decode_fast, decode_fast_hybrid, decode_native
from pagefold.models.llama import DecoderModel
from pagefold.models.qwen3_5 import HybridModel
from pagefold.testing.decode_plans import count_plan_calls
from pagefold.testing.tiny_models import random_prompts

SP = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)


def _run(model_dir, prompts: list[list[int]]) -> list[tuple]:
    llm = LLM(str(model_dir), dtype="bfloat16", max_model_len=256, kv_cache_memory="16MiB")
    out = []
    for group in (prompts[:1], prompts[:2], prompts):  # 1, 2, then 3 concurrent requests
        for o in llm.generate([{"prompt_token_ids": p} for p in group], SP, use_tqdm=False):
            c = o.outputs[0]
            out.append((c.token_ids, [sorted(d.items()) for d in c.logprobs]))
    llm.engine.kv.check_whole()
    return out


@pytest.mark.skipif(cpu_ops.kernels() is None, reason="no C++ compiler")
@pytest.mark.parametrize("arch,gemv_rows,native", [
    ("llama", None, True), ("qwen2", None, True), ("qwen3", None, True), ("llama", 1, True),
    ("qwen3", 1, True), ("qwen2", None, False), ("qwen3", None, False)])
def test_fast_decode_is_bitwise_the_module_path(arch, gemv_rows, native, tiny_model_factory,
                                                monkeypatch):
    """native: the GEMV steps run as one C call (decode_native), else the Python plan."""
    if gemv_rows is not None:
        monkeypatch.setattr(cpu_ops, "GEMV_MAX_ROWS", gemv_rows)
    monkeypatch.setattr(decode_native, "ENABLED", native)
    model = tiny_model_factory(arch)
    prompts = random_prompts(3, 5, 40, 400, seed=4)
    calls, native_calls = count_plan_calls(monkeypatch, decode_fast.DensePlan)
    fast = _run(model, prompts)
    assert calls[0] > 0
    assert (native_calls[0] > 0) == native
    if native and gemv_rows == 1:
        assert native_calls[0] < calls[0]  # batches above the GEMV's rows: the Python plan
    monkeypatch.setattr(DecoderModel, "fast_decode", False)
    n = calls[0]
    slow = _run(model, prompts)
    assert calls[0] == n  # the module path only
    assert fast == slow


@pytest.mark.skipif(cpu_ops.kernels() is None, reason="no C++ compiler")
@pytest.mark.parametrize("arch,gemv_rows,native", [
    ("qwen3_5", None, True), ("qwen3_next", None, True), ("qwen3_5", 1, True),
    ("qwen3_next", 1, True), ("qwen3_5", None, False), ("qwen3_next", None, False)])
def test_hybrid_fast_decode_is_bitwise_the_module_path(arch, gemv_rows, native,
                                                       tiny_model_factory, monkeypatch):
    """native: the GEMV steps run as one C call (decode_native, Qwen3-Next's sparse MoE blocks
    included), else the Python plan (the MoE blocks through their own forward)."""
    if gemv_rows is not None:
        monkeypatch.setattr(cpu_ops, "GEMV_MAX_ROWS", gemv_rows)
    monkeypatch.setattr(decode_native, "ENABLED", native)
    model = tiny_model_factory(arch)
    prompts = random_prompts(3, 5, 40, 400, seed=5)
    calls, native_calls = count_plan_calls(monkeypatch, decode_fast_hybrid.HybridPlan)
    fast = _run(model, prompts)
    assert calls[0] > 0
    assert (native_calls[0] > 0) == native
    if native and gemv_rows == 1:
        assert native_calls[0] < calls[0]  # batches above the GEMV's rows: the Python plan
    monkeypatch.setattr(HybridModel, "fast_decode", False)
    n = calls[0]
    slow = _run(model, prompts)
    assert calls[0] == n  # the module path only
    assert fast == slow


@pytest.mark.skipif(cpu_ops.kernels() is None, reason="no C++ compiler")
def test_verify_steps_take_the_plan_with_the_module_paths_bits(tiny_model_factory, monkeypatch):
    """Speculative verify chunks (1 + k rows of one request, each attending as a decode row)
    run through the plan, with the module path's tokens and logprobs."""
    model = str(tiny_model_factory("qwen3"))
    prompts = random_prompts(2, 20, 40, 400, seed=7)
    rows = []
    forward = decode_fast.DensePlan.forward

    def counting(self, x, *args, **kw):
        rows.append(x.shape[0])
        return forward(self, x, *args, **kw)

    monkeypatch.setattr(decode_fast.DensePlan, "forward", counting)

    def run():
        llm = LLM(model, dtype="bfloat16", max_model_len=256, kv_cache_memory="16MiB",
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3})
        # drafts: the last three tokens again (some accepted on repetitive greedy output)
        llm.engine.spec.propose_fn = lambda req, k: list(req.all_token_ids[-k:])
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:1]], SP,
                            use_tqdm=False)
        llm.engine.kv.check_whole()
        c = outs[0].outputs[0]
        return c.token_ids, [sorted(d.items()) for d in c.logprobs]

    fast = run()
    assert 4 in rows  # a verify step of 1 + 3 rows took the plan
    monkeypatch.setattr(DecoderModel, "fast_decode", False)
    n = len(rows)
    slow = run()
    assert len(rows) == n
    assert fast == slow
