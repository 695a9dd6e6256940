"""gpt-oss with MXFP4 experts (``*_blocks`` / ``*_scales`` as the published checkpoints store
them) against transformers running the same experts dequantized.

The MXFP4 checkpoint is written here from a tiny random gpt-oss by a quantizer written from the
OCP Microscaling spec (nothing of pagefold is used to make or decode it): per block of 32
inputs of each output row, an E8M0 scale ``2 ** (s - 127)`` with ``s`` the smallest exponent
that keeps the block's largest magnitude within 6, and each value the nearest E2M1 value
(0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives; code = sign << 3 | magnitude index) of w / scale,
two codes a byte, the even input in the low nibble. The gate/up matrix's rows are its
``(E, hidden, 2I)`` columns. The dequantized weights, saved plain, are transformers' input.
"""

from __future__ import annotations

import json
import logging
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagefold import LLM
from pagefold.testing.oracle import hf_greedy
from tests.test_quantization import N_NEW, PROMPTS, _pagefold

MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
CONFIG = dict(hidden_size=64, intermediate_size=64, num_attention_heads=4)


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w (..., R, K) -> blocks (..., R, K/32, 16) uint8, scales (..., R, K/32) uint8, and the
    dequantized (..., R, K) float32."""
    *lead, r, k = w.shape
    wb = w.reshape(*lead, r, k // 32, 32).double()
    amax = wb.abs().amax(dim=-1)
    exp = torch.zeros_like(amax, dtype=torch.int64)
    for idx in torch.nonzero(amax > 0):
        a = float(amax[tuple(idx)])
        exp[tuple(idx)] = math.ceil(math.log2(a / 6.0))  # a / 2**exp <= 6
    s = (exp + 127).clamp(1, 254)
    scale = torch.pow(2.0, (s - 127).double())
    v = wb / scale[..., None]
    mag = (v.abs()[..., None] - MAGNITUDES.double()).abs().argmin(dim=-1)  # nearest magnitude
    codes = mag | ((v < 0).long() << 3)
    deq = MAGNITUDES.double()[mag] * torch.where(v < 0, -1.0, 1.0) * scale[..., None]
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, s.to(torch.uint8), deq.reshape(*lead, r, k).float()


def write_mxfp4(src, dst, ref) -> None:
    for d in (dst, ref):
        shutil.copytree(src, d)
    tensors = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(4)
    q, plain = {}, {}
    for name, t in tensors.items():
        if name.endswith("_bias") and not t.any():  # biases that matter
            t = 0.1 * torch.randn(t.shape, generator=gen)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            rows = t.transpose(1, 2)  # (E, out, in): blocks run along the inputs
            blocks, scales, deq = mxfp4_quantize(rows)
            q[f"{name}_blocks"], q[f"{name}_scales"] = blocks, scales
            plain[name] = deq.transpose(1, 2).contiguous()
        else:
            q[name] = plain[name] = t
    save_file(q, str(dst / "model.safetensors"))
    save_file(plain, str(ref / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (dst / "config.json").write_text(json.dumps(cfg))


def test_mxfp4_experts_match_dequantized_transformers(tiny_model_factory, tmp_path, caplog):
    write_mxfp4(tiny_model_factory("gpt_oss", **CONFIG), tmp_path / "q", tmp_path / "ref")
    assert _pagefold(tmp_path / "q") == hf_greedy(tmp_path / "ref", PROMPTS, N_NEW)
    with caplog.at_level(logging.INFO, logger="pagefold"):
        llm = LLM(str(tmp_path / "q"), dtype="float32", max_model_len=64,
                  kv_cache_memory=4 << 20)
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights:")]
    assert "mxfp4: 8 tensors" in summary[-1], summary  # 2 projections x 4 layers
    experts = llm.engine.model.model.layers[0].mlp.experts
    assert experts.gate_up_proj is None and experts.down_proj_blocks.dtype == torch.uint8


@pytest.mark.slow
def test_mxfp4_experts_tp2(tiny_model_factory, tmp_path):
    """Two ranks: the gate/up rows of each rank's intermediate channels, the down blocks of its
    32 inputs."""
    write_mxfp4(tiny_model_factory("gpt_oss", **CONFIG), tmp_path / "q", tmp_path / "ref")
    llm = LLM(str(tmp_path / "q"), dtype="float32", max_model_len=64, kv_cache_memory=4 << 20,
              tensor_parallel_size=2, threads_per_rank=1)
    try:
        from pagefold import SamplingParams

        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True),
                            use_tqdm=False)
        got = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.engine.shutdown()
    assert got == hf_greedy(tmp_path / "ref", PROMPTS, N_NEW)


def test_truncated_mxfp4_tensor_names_it(tiny_model_factory, tmp_path):
    write_mxfp4(tiny_model_factory("gpt_oss", **CONFIG), tmp_path / "q", tmp_path / "ref")
    f = tmp_path / "q" / "model.safetensors"
    t = load_file(str(f))
    key = "model.layers.1.mlp.experts.down_proj_blocks"
    t[key] = t[key][:, :, :1].contiguous()  # one block of the two per row
    save_file(t, str(f))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.down_proj_blocks: mxfp4 "
                                         r"tensor .*truncated or corrupt"):
        LLM(str(tmp_path / "q"), dtype="float32", max_model_len=64, kv_cache_memory=4 << 20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_decode_is_exact(dtype):
    """Every code with every scale byte whose values stay finite in float32 (up to 252: 6 *
    2^125), decoded straight into float32 or bfloat16, equals the spec's value."""
    from pagefold.quantization.mxfp4 import dequantize_mxfp4

    blocks = torch.arange(256, dtype=torch.int64).to(torch.uint8).reshape(16, 1, 16)
    blocks = blocks.repeat(253, 1, 1)  # (253 * 16 rows, 1 block, 16 bytes)
    scales = torch.arange(253).repeat_interleave(16).to(torch.uint8).reshape(-1, 1)
    lut = torch.cat([MAGNITUDES, -MAGNITUDES]).double()
    codes = torch.stack((blocks & 15, blocks >> 4), dim=-1).reshape(-1, 32).long()
    want = lut[codes] * torch.pow(2.0, scales.double() - 127)
    got = dequantize_mxfp4(blocks, scales, dtype)
    assert got.dtype == dtype and torch.equal(got.double(), want)


@pytest.mark.slow
def test_mxfp4_experts_ep2(tiny_model_factory, tmp_path):
    """Expert parallelism: each rank keeps the blocks and scales of its 2 of the 4 experts
    whole (cut along the expert axis), and the tokens equal transformers' on the dequantized
    weights."""
    write_mxfp4(tiny_model_factory("gpt_oss", **CONFIG, num_local_experts=4), tmp_path / "q",
                tmp_path / "ref")
    llm = LLM(str(tmp_path / "q"), dtype="float32", max_model_len=64, kv_cache_memory=4 << 20,
              tensor_parallel_size=2, enable_expert_parallel=True, threads_per_rank=1)
    try:
        from pagefold import SamplingParams

        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True),
                            use_tqdm=False)
        got = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.engine.shutdown()
    assert got == hf_greedy(tmp_path / "ref", PROMPTS, N_NEW)


@pytest.fixture(params=[0, 1, 2], ids=["best", "avx2", "scalar"])
def mxfp4_isa(request):
    """Each form of ``pf_qgemv_mxfp4`` (AVX-512, AVX2 + FMA, scalar) in turn."""
    from pagefold.csrc import cpu_ops

    lib = cpu_ops.kernels()
    if lib is None:
        pytest.skip("no compiled kernels")
    old = lib.pf_mxfp4_limit_isa(request.param)
    yield lib
    lib.pf_mxfp4_limit_isa(old)


def test_mxfp4_kernel_matches_the_spec_on_awkward_shapes(mxfp4_isa):
    """``mxfp4_linear`` on 1..33 rows (33: past the compiled kernel's 32, the tile-decoding
    reference) against the spec's values in float64 (codes and E8M0 scales decoded here, the
    subnormal scale byte 0 included), odd block counts and output rows: within float32
    rounding of the sums; a row's result does not depend on the rows beside it."""
    from pagefold.quantization.mxfp4 import mxfp4_linear

    gen = torch.Generator().manual_seed(11)
    lut = torch.cat([MAGNITUDES, -MAGNITUDES]).double()
    for n, groups in ((37, 3), (5, 1), (16, 5)):
        k = 32 * groups
        blocks = torch.randint(0, 256, (n, groups, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(118, 136, (n, groups), generator=gen, dtype=torch.uint8)
        scales[0, 0] = 0  # 2^-127: subnormal weights
        codes = torch.stack((blocks & 15, blocks >> 4), dim=-1).reshape(n, groups, 32).long()
        w = (lut[codes] * torch.pow(2.0, scales.double() - 127)[..., None]).reshape(n, k)
        for m in (1, 2, 3, 4, 5, 17, 32, 33):
            x = torch.randn(m, k, generator=gen)
            got = mxfp4_linear(x, blocks, scales)
            want = x.double() @ w.t()
            bound = 1e-5 * (x.double().abs() @ w.abs().t()) + 1e-30
            assert got.dtype == torch.float32 and got.shape == (m, n)
            assert ((got.double() - want).abs() <= bound).all(), (n, k, m)
            if m <= 32:
                assert torch.equal(mxfp4_linear(x[m - 1:].contiguous(), blocks, scales),
                                   got[m - 1:])
        xb = torch.randn(3, k, generator=gen).bfloat16()
        got = mxfp4_linear(xb, blocks, scales)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), xb.double() @ w.t(), rtol=1e-2, atol=1e-6)


def test_mxfp4_kernel_takes_few_rows():
    """The compiled kernel answers 1..32 rows (its bits, not the reference's); a width that is
    not whole blocks, or 65 rows, is refused with nothing written."""
    from pagefold.csrc import cpu_ops
    from pagefold.quantization.mxfp4 import mxfp4_linear

    lib = cpu_ops.kernels()
    if lib is None:
        pytest.skip("no compiled kernels")
    gen = torch.Generator().manual_seed(12)
    blocks = torch.randint(0, 256, (9, 2, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 130, (9, 2), generator=gen, dtype=torch.uint8)
    x = torch.randn(4, 64, generator=gen)
    y = torch.full((4, 9), 7.0)
    assert lib.pf_qgemv_mxfp4(x.data_ptr(), 4, 64, 9, blocks.data_ptr(), scales.data_ptr(),
                              y.data_ptr(), 9, 1) == 0
    assert torch.equal(mxfp4_linear(x, blocks, scales), y)
    z = torch.full((4, 9), 7.0)
    for m, k in ((4, 48), (65, 64)):
        assert lib.pf_qgemv_mxfp4(x.data_ptr(), m, k, 9, blocks.data_ptr(), scales.data_ptr(),
                                  z.data_ptr(), 9, 1) == 1
    assert bool((z == 7.0).all())
