"""The Nemotron-H fast decode path (pagefold.layers.decode_fast_nemotron) gives the module
path's bits: same tokens and logprobs (bf16, greedy) at batch 1, 2 and 3, for the plain tiny
model (Mamba-2, attention without RoPE, relu^2 MLP blocks) and the MoE one (a MoE block
through its own forward); with the GEMV's row limit at 1, batches above 1 take each linear's
own forward. The fast path must actually have run, and the single C call of the native
step (``decode_native``) where its blocks allow it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagefold import LLM, SamplingParams
from pagefold.csrc import cpu_ops
from pagefold.layers import decode_fast_nemotron, decode_native
from pagefold.models.nemotron_h import NemotronHModel
from pagefold.ops.elementwise import cpu as elementwise_cpu
from pagefold.testing.decode_plans import count_plan_calls
from pagefold.testing.tiny_models import random_prompts

# Mamba-2, MoE (latent projections, a shared expert), attention and MLP blocks.
MOE = dict(layers_block_type=["linear_attention", "moe", "full_attention", "moe",
                              "linear_attention", "mlp"],
           n_routed_experts=8, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
           num_experts_per_tok=2, n_group=2, topk_group=1, moe_latent_size=24)
SP = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)


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


def _run(model_dir, prompts: list[list[int]]) -> list[tuple]:
    llm = LLM(str(model_dir), dtype="bfloat16", max_model_len=256, kv_cache_memory="16MiB")
    out = []
    for group in (prompts[:1], prompts[:2], prompts):  # 1, 2, then 3 concurrent requests
        for o in llm.generate([{"prompt_token_ids": p} for p in group], SP, use_tqdm=False):
            c = o.outputs[0]
            out.append((c.token_ids, [sorted(d.items()) for d in c.logprobs]))
    return out


@pytest.mark.skipif(cpu_ops.kernels() is None, reason="no C++ compiler")
@pytest.mark.parametrize("arch,gemv_rows,native", [
    ("nemotron_h", None, True), ("nemotron_h_moe", None, False), ("nemotron_h", 1, True),
    ("nemotron_h", None, False)])
def test_nemotron_fast_decode_is_bitwise_the_module_path(arch, gemv_rows, native,
                                                         tiny_model_factory, monkeypatch,
                                                         tmp_path):
    """native: the GEMV steps run as one C call (decode_native), else the Python plan (the
    MoE block has no native part: its model always takes the Python plan)."""
    if gemv_rows is not None:
        monkeypatch.setattr(cpu_ops, "GEMV_MAX_ROWS", gemv_rows)
    monkeypatch.setattr(decode_native, "ENABLED", native)
    src = tiny_model_factory("nemotron_h", **MOE) if arch == "nemotron_h_moe" else \
        tiny_model_factory(arch)
    model = _random_norms(src, tmp_path / "model")
    prompts = random_prompts(3, 5, 40, 400, seed=6)
    calls, native_calls = count_plan_calls(monkeypatch, decode_fast_nemotron.NemotronHPlan)
    fast = _run(model, prompts)
    assert calls[0] > 0
    assert (native_calls[0] > 0) == native
    if native and gemv_rows == 1:
        assert native_calls[0] < calls[0]  # batches above the GEMV's rows: the Python plan
    monkeypatch.setattr(NemotronHModel, "fast_decode", False)
    n = calls[0]
    slow = _run(model, prompts)
    assert calls[0] == n  # the module path only
    assert fast == slow


@pytest.mark.skipif(cpu_ops.kernels() is None, reason="no C++ compiler")
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
        llama = elementwise_cpu.rms_norm(x, norm.weight, norm.eps, False)
        assert not torch.equal(llama, got)
