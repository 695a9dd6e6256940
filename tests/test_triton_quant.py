"""The Triton weight-only product (int4 / int8 / FP8 kernel-layout weights) against a torch
dequantize-and-matmul reference written here, at awkward shapes: 1..33 rows, inputs not a
multiple of the kernel's block, odd group counts, outputs not a multiple of the tile, every
finite FP8 byte. Without CUDA it runs under Triton's interpreter (``TRITON_INTERPRET=1``, set
before triton is imported), as the other Triton kernels' tests do."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from pagefold.kernels import dispatch  # noqa: E402
from pagefold.ops.quant.triton import qgemm  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _weight(n: int, k: int, bits: int, fp8: bool, group: int, gen: torch.Generator):
    """Kernel-layout codes / scales / zeros and the float32 weight they stand for."""
    groups = k // group
    scale = torch.rand(n, groups, generator=gen) + 0.05
    if fp8:
        codes = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x3C  # NaN bytes: not weights
        zero = torch.zeros(n, groups)
        q = codes.view(torch.float8_e4m3fn).float()
    else:
        codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
        zero = torch.randint(0, 1 << bits, (n, groups), generator=gen).float()
        q = codes.float()
    cols = torch.arange(k) // group
    w = (q - zero[:, cols]) * scale[:, cols]
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return codes.contiguous(), scale, zero, w


@pytest.mark.parametrize(("bits", "fp8", "n", "k", "group"), [
    (4, False, 37, 96, 32),    # three groups, outputs not a multiple of the tile
    (4, False, 50, 130, 130),  # one group, inputs not a multiple of the block
    (4, False, 9, 40, 8),      # five groups of 8
    (8, False, 33, 45, 15),    # odd inputs, three groups
    (8, True, 40, 70, 70),     # fp8, per channel
    (8, True, 17, 96, 32),     # fp8, block scales along the inputs
])
@pytest.mark.parametrize("m", [1, 5, 17, 33])
def test_qgemm_matches_torch_reference(bits, fp8, n, k, group, m):
    gen = torch.Generator().manual_seed(n * 1000 + k + m)
    codes, scale, zero, w = _weight(n, k, bits, fp8, group, gen)
    x = torch.randn(m, k, generator=gen)
    wide = torch.full((m, n + 7), float("nan"))  # a column slice of a wider output
    out = wide[:, 3:3 + n]
    qgemm(x.to(DEV), codes.to(DEV), scale.to(DEV), zero.to(DEV), bits, fp8, group,
          out if DEV.type == "cpu" else out.to(DEV))
    if DEV.type != "cpu":
        out = out.cpu()
    want = (x.double() @ w.double().t()).float()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    assert torch.isnan(wide[:, :3]).all() and torch.isnan(wide[:, 3 + n:]).all()


def test_int_weight_takes_the_triton_kernel(monkeypatch):
    """With the Triton path on, a quantized layer's product runs the kernel (act-order
    permutation included) and equals the layer's torch reference."""
    from pagefold.quantization.formats import GPTQ
    from pagefold.quantization.int_kernel import IntWeight

    gen = torch.Generator().manual_seed(5)
    n, k, group = 16, 64, 32
    words = torch.randint(-(1 << 31), 1 << 31, (k // 8, n), generator=gen, dtype=torch.int64)
    tensors = {"qweight": words.to(torch.int32),
               "qzeros": torch.randint(0, 1 << 30, (2, n // 8), generator=gen,
                                       dtype=torch.int32),
               "scales": (torch.rand(2, n, generator=gen) + 0.1).half(),
               "g_idx": (torch.randperm(k, generator=gen) % 2).to(torch.int32)[None]}
    weight = IntWeight(GPTQ(4, group), tensors, {"": (0, n)}, n, k)
    assert weight.segments[0][2] is not None  # act-order: a permutation
    x = torch.randn(3, k, generator=gen)
    calls = []
    import pagefold.ops.quant.triton as tq

    real = tq.qgemm
    monkeypatch.setattr(tq, "qgemm", lambda *a: (calls.append(1), real(*a))[1])
    dispatch.set_mode("triton")
    try:
        got = weight.matmul(x)
    finally:
        dispatch.set_mode("auto")
    assert calls
    torch.testing.assert_close(got, weight.reference(x), rtol=1e-5, atol=1e-4)


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


@pytest.mark.parametrize(("n", "k"), [(37, 96), (8, 32), (70, 160)])
@pytest.mark.parametrize("m", [1, 6, 33])
def test_mxfp4_gemm_matches_torch_reference(n, k, m):
    """Every E2M1 code, scales from 2^-127 (s = 0, subnormal) to 2^10."""
    from pagefold.ops.quant.triton import mxfp4_gemm

    gen = torch.Generator().manual_seed(n + k + m)
    blocks = torch.randint(0, 256, (n, k // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 138, (n, k // 32), generator=gen, dtype=torch.uint8)
    scales[0, 0] = 0
    codes = torch.stack((blocks & 15, blocks >> 4), dim=-1).reshape(n, k // 32, 32).long()
    w = (E2M1[codes].double() * torch.pow(2.0, scales.double() - 127)[..., None]).reshape(n, k)
    x = torch.randn(m, k, generator=gen)
    got = mxfp4_gemm(x.to(DEV), blocks.to(DEV), scales.to(DEV)).cpu()
    want = x.double() @ w.t()
    bound = 1e-5 * (x.double().abs() @ w.abs().t()) + 1e-30  # float32 sums of k terms
    assert ((got.double() - want).abs() <= bound).all()


def test_mxfp4_experts_take_the_triton_kernel(monkeypatch):
    """With the Triton path on, gpt-oss's MXFP4 expert product is the kernel's, equal to the
    tile-decoding torch product."""
    from pagefold.quantization.mxfp4 import mxfp4_linear, mxfp4_reference

    gen = torch.Generator().manual_seed(9)
    blocks = torch.randint(0, 256, (24, 2, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 130, (24, 2), generator=gen, dtype=torch.uint8)
    x = torch.randn(3, 64, generator=gen)
    want = mxfp4_reference(x, blocks, scales)
    import pagefold.ops.quant.triton as tq

    calls, real = [], tq.mxfp4_gemm
    monkeypatch.setattr(tq, "mxfp4_gemm", lambda *a: (calls.append(1), real(*a))[1])
    dispatch.set_mode("triton")
    try:
        got = mxfp4_linear(x, blocks, scales)
    finally:
        dispatch.set_mode("auto")
    assert calls
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
