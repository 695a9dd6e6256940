"""The native decode step (``pagefold.layers.decode_native``, one C call per step) gives the
module path's bits: same tokens and same logprobs (bf16, greedy) with it on and off, for every
family whose blocks have compiled kernels: Llama (GQA 4:2), Qwen2 (qkv bias, MQA), Qwen3 (q/k
norm; MHA and GQA 4:1 variants), Qwen3.5 (GDN + gated attention with partial RoPE), Qwen3-Next
(sparse MoE blocks), Nemotron-H (Mamba-2, RoPE-free attention, relu^2 MLP; random norm
weights), Bamba (Mamba-2 + partial-RoPE attention, SwiGLU MLP; float32 SSM states) and
Mamba-2 (a bf16 residual stream; float32 SSM states). Batches of 1, 2 and 3
requests, the first prompt again in every batch (prefix-cache hits, and for the state models
checkpoint captures, which take the module path for their step); with the GEMV's row limit at 1
every batch above 1 runs natively with each linear and MoE block through its own forward (the
batched GEMM, the grouped experts). The native step must actually have run (and not
run with it off); a family whose part has no compiled kernel (Nemotron-H's MoE, Granite's
scaled residuals, Mamba-2's float32 residual stream) never takes it."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagefold import LLM, SamplingParams
from pagefold.csrc import cpu_ops, gemv_choice
from pagefold.layers import decode_native
from pagefold.ops import elementwise
from pagefold.testing.tiny_models import random_prompts

SP = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
# Nemotron-H with MoE blocks (latent projections, a shared expert): no native part.
NEMOTRON_MOE = dict(layers_block_type=["linear_attention", "moe", "full_attention", "moe",
                                       "linear_attention", "mlp"],
                    n_routed_experts=8, moe_intermediate_size=32,
                    moe_shared_expert_intermediate_size=48, num_experts_per_tok=2, n_group=2,
                    topk_group=1, moe_latent_size=24)
# Bamba's SSM states default to the KV cache dtype (bf16), which the compiled Mamba-2 decode
# step does not take (the module path's torch step runs): its float32 pool runs natively.
ENGINE = {v: {"mamba_ssm_cache_dtype": "float32"} for v in ("bamba", "mamba2")}
VARIANTS = {
    "llama": ("llama", {}), "qwen2": ("qwen2", {}), "qwen3": ("qwen3", {}),
    "qwen3_mha": ("qwen3", {"num_key_value_heads": 4}),
    "qwen3_gqa4": ("qwen3", {"num_key_value_heads": 1}),
    "qwen3_5": ("qwen3_5", {}), "qwen3_next": ("qwen3_next", {}),
    "nemotron_h": ("nemotron_h", {}), "bamba": ("bamba", {}),
    "mamba2": ("mamba2", {"residual_in_fp32": False}),
    "mamba2_fp32_residual": ("mamba2", {"residual_in_fp32": True}),
    "nemotron_h_moe": ("nemotron_h", NEMOTRON_MOE),
    "granitemoehybrid": ("granitemoehybrid", {}),
}
NOT_NATIVE = {"nemotron_h_moe", "granitemoehybrid", "mamba2_fp32_residual"}
needs_kernels = pytest.mark.skipif(cpu_ops.kernels() is None, reason="no C++ compiler")


def _random_norms(src: Path, dst: Path) -> Path:
    """A copy of ``src`` whose norm weights are random (all ones would hide the norms'
    rounding: ``w * T(h)`` and ``T(h * w)`` agree at ``w == 1``)."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name, t in weights.items():
        if name.endswith("norm.weight"):
            weights[name] = (1 + 0.3 * torch.randn(t.shape, generator=gen)).to(t.dtype)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def count_native_steps(monkeypatch) -> list[int]:
    """The rows of each step the native driver ran (``NativeBlocks.forward`` returning a
    result), appended as the engine runs."""
    rows: list[int] = []
    forward = decode_native.NativeBlocks.forward

    def counting(self, x, *args, **kw):
        out = forward(self, x, *args, **kw)
        if out is not None:
            rows.append(x.shape[0])
        return out

    monkeypatch.setattr(decode_native.NativeBlocks, "forward", counting)
    return rows


def _run(model_dir, prompts: list[list[int]], **engine) -> list[tuple]:
    llm = LLM(str(model_dir), dtype="bfloat16", max_model_len=256, kv_cache_memory="16MiB",
              **engine)
    out = []
    for group in (prompts[:1], prompts[:2], prompts):  # 1, 2, then 3 concurrent requests
        for o in llm.generate([{"prompt_token_ids": p} for p in group], SP, use_tqdm=False):
            c = o.outputs[0]
            out.append((c.token_ids, [sorted(d.items()) for d in c.logprobs]))
    llm.engine.kv.check_whole()
    return out


@needs_kernels
@pytest.mark.parametrize("variant,gemv_rows", [
    *((v, None) for v in VARIANTS), ("qwen2", 1), ("qwen3", 1), ("qwen3_5", 1),
    ("qwen3_next", 1), ("nemotron_h", 1), ("bamba", 1)])
def test_native_step_is_bitwise_the_module_path(variant, gemv_rows, tiny_model_factory,
                                                monkeypatch, tmp_path):
    if gemv_rows is not None:  # every weight's GEMV takes this many rows at most
        choose = gemv_choice.choose
        monkeypatch.setattr(gemv_choice, "choose", lambda *a, **kw: {
            s: dataclasses.replace(c, max_rows=min(c.max_rows, gemv_rows))
            for s, c in choose(*a, **kw).items()})
    arch, kw = VARIANTS[variant]
    model = tiny_model_factory(arch, **kw)
    if arch == "nemotron_h":
        model = _random_norms(model, tmp_path / "model")
    prompts = random_prompts(3, 5, 40, 400, seed=4)
    rows = count_native_steps(monkeypatch)
    monkeypatch.setattr(decode_native, "ENABLED", True)
    native = _run(model, prompts, **ENGINE.get(variant, {}))
    ran = len(rows)
    monkeypatch.setattr(decode_native, "ENABLED", False)
    module = _run(model, prompts, **ENGINE.get(variant, {}))
    assert len(rows) == ran  # off: the module path only
    assert (ran > 0) == (variant not in NOT_NATIVE)
    if gemv_rows == 1:  # above the GEMV's rows: each linear's and MoE block's own forward
        assert max(rows) > 1
    assert native == module


@needs_kernels
def test_verify_steps_take_the_native_step_with_the_module_paths_bits(tiny_model_factory,
                                                                      monkeypatch):
    """Speculative verify chunks (1 + k rows of one request, each attending as a decode row)
    of a dense model run natively, with the module path's tokens and logprobs."""
    model = str(tiny_model_factory("qwen3"))
    prompts = random_prompts(2, 20, 40, 400, seed=7)
    rows = []
    forward = decode_native.NativeBlocks.forward

    def counting(self, x, *args, **kw):
        out = forward(self, x, *args, **kw)
        if out is not None:
            rows.append(x.shape[0])
        return out

    monkeypatch.setattr(decode_native.NativeBlocks, "forward", counting)

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
    assert 4 in rows  # a verify step of 1 + 3 rows ran natively
    monkeypatch.setattr(decode_native, "ENABLED", False)
    n = len(rows)
    slow = run()
    assert len(rows) == n
    assert fast == slow


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nemotron_norm_kernel_is_the_reference(dtype):
    """NemotronHRMSNorm on the CPU runs the kernel's float32-weight mode: the reference's
    value (the sum of squares in another order), not the Llama norm's rounding."""
    from pagefold.models.nemotron_h import NemotronHRMSNorm

    gen = torch.Generator().manual_seed(1)
    norm = NemotronHRMSNorm(96, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(96, generator=gen))
    x = torch.randn(7, 96, generator=gen).to(dtype)
    got, ref = norm(x), norm.reference(x)
    assert got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    if dtype == torch.bfloat16:  # rounding flips are rare; the Llama norm's w * T(h) differs
        assert (got == ref).float().mean() > 0.98
        llama = elementwise.rms_norm(x, norm.weight, norm.eps, False)
        assert not torch.equal(llama, got)


@needs_kernels
@pytest.mark.parametrize("variant,kw", [
    ("qwen3", dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=64)),
    ("qwen3_next", dict(hidden_size=512, moe_intermediate_size=256,
                        shared_expert_intermediate_size=384))],
    ids=["qwen3-h512", "qwen3_next-h512"])
def test_native_step_takes_each_matrixs_own_gemv(variant, kw, tiny_model_factory, monkeypatch):
    """Weight shapes routed to different kernels (round robin over the kernels this CPU runs,
    by shape): the driver calls each matrix's own GEMV (its record's address; the MoE experts'
    gate_up / down pair), so its tokens and logprobs stay the module path's."""
    names = [c.name for c in gemv_choice.available(cpu_ops.kernels())]
    if len(names) < 2:
        pytest.skip("one GEMV kernel on this CPU")

    def mixed(lib, shapes, **_):
        return {s: gemv_choice.make_choice(lib, names[i % len(names)], 32)
                for i, s in enumerate(sorted(set(shapes)))}

    monkeypatch.setattr(gemv_choice, "choose", mixed)
    model = tiny_model_factory(variant, **kw)
    prompts = random_prompts(3, 5, 40, 400, seed=4)
    rows = count_native_steps(monkeypatch)
    monkeypatch.setattr(decode_native, "ENABLED", True)
    native = _run(model, prompts)
    assert rows
    monkeypatch.setattr(decode_native, "ENABLED", False)
    assert native == _run(model, prompts)
