"""The compiled integer-weight product (``csrc/quant.cpp``) against the weight decoded here.

Codes, scales and zeros are drawn at random; the expected product is ``x @ (scale * (code -
zero)).T`` computed in float64 in this file. Awkward shapes: group counts of 1-5, groups that
are not a multiple of the 16-code vector step, inputs not a multiple of 8, rows 1..33 (33
leaves the kernel for the tiled reference). A row's result must not depend on the rows beside
it (speculative verify rows equal decode rows), and act-order permutations of the inputs must
give the unpermuted product.
"""

from __future__ import annotations

import pytest
import torch

from pagefold.csrc import cpu_ops
from pagefold.quantization.formats import GPTQ
from pagefold.quantization.int_kernel import KERNEL_MAX_ROWS, IntWeight

pytestmark = pytest.mark.skipif(cpu_ops.kernels() is None, reason="no C++ compiler")


def _gptq_tensors(n: int, k: int, bits: int, group: int, perm: bool, gen: torch.Generator):
    """GPTQ v1 tensors of random codes, and the float64 weight they stand for."""
    per, top = 32 // bits, (1 << bits) - 1
    groups = k // group
    q = torch.randint(0, top + 1, (k, n), generator=gen)
    z = torch.randint(1, top + 1, (groups, n), generator=gen)
    s = torch.rand(groups, n, generator=gen).half() * 0.1 + 0.01
    order = torch.randperm(k, generator=gen) if perm else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // group
    w = torch.empty(n, k, dtype=torch.float64)
    for kk in range(k):
        g = int(g_idx[kk])
        w[:, kk] = s[g].double() * (q[kk] - z[g]).double()

    def pack(vals: torch.Tensor) -> torch.Tensor:  # (rows, cols) along rows -> int32 words
        words = torch.zeros(vals.shape[0] // per, vals.shape[1], dtype=torch.int64)
        for i in range(vals.shape[0]):
            words[i // per] += vals[i] << (bits * (i % per))
        words %= 1 << 32
        return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)

    t = {"qweight": pack(q), "qzeros": pack((z - 1).t()).t().contiguous(), "scales": s,
         "g_idx": g_idx.to(torch.int32)[None]}
    return t, w


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n, k, group", [(24, 72, 24), (40, 160, 32), (16, 48, 48),
                                         (8, 80, 16)])
@pytest.mark.parametrize("perm", [False, True])
def test_kernel_matches_decoded_weight(bits, n, k, group, perm):
    gen = torch.Generator().manual_seed(n * k + bits)
    t, w = _gptq_tensors(n, k, bits, group, perm, gen)
    iw = IntWeight(GPTQ(bits, group, sym=False), t, {"": (0, n)}, n, k)
    x = torch.randn(33, k, generator=gen)
    want = x.double() @ w.t()
    for rows in (1, 2, 3, 5, 8, 17, 32, 33):
        got = iw.matmul(x[:rows])
        assert (iw._kernel(x[:rows]) is not None) == (rows <= KERNEL_MAX_ROWS)
        torch.testing.assert_close(got.double(), want[:rows], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(iw.reference(x[:rows]).double(), want[:rows], rtol=1e-5,
                                   atol=1e-4)
    single = torch.cat([iw.matmul(x[r:r + 1]) for r in range(KERNEL_MAX_ROWS)])
    assert torch.equal(single, iw.matmul(x[:KERNEL_MAX_ROWS]))  # rows independent, bitwise


def test_fused_shards_with_their_own_permutations():
    gen = torch.Generator().manual_seed(3)
    ta, wa = _gptq_tensors(16, 64, 4, 16, True, gen)
    tb, wb = _gptq_tensors(8, 64, 4, 16, True, gen)
    t = {"qweight": torch.cat([ta["qweight"], tb["qweight"]], 1),
         "qzeros": torch.cat([ta["qzeros"], tb["qzeros"]], 1),
         "scales": torch.cat([ta["scales"], tb["scales"]], 1),
         "g_idx": torch.cat([ta["g_idx"], tb["g_idx"]])}
    iw = IntWeight(GPTQ(4, 16, sym=False), t, {"a": (0, 16), "b": (16, 8)}, 24, 64)
    x = torch.randn(3, 64, generator=gen)
    want = x.double() @ torch.cat([wa, wb]).t()
    torch.testing.assert_close(iw.matmul(x).double(), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(iw.matmul(x.bfloat16()).double(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("scale, n, k", [("channel", 24, 72), ("tensor", 8, 40),
                                         ("block", 32, 96), ("channel", 8, 37)])
def test_fp8_kernel_matches_torch_decode(scale, n, k):
    """FP8 weights through the same kernel: every finite float8_e4m3fn byte (subnormals and
    negative zero included) decoded as torch decodes it, times per-channel, per-tensor or
    (16 x 32) block scales; 37 inputs leave a tail past the 8-wide vector loop."""
    from pagefold.quantization.formats import FP8

    gen = torch.Generator().manual_seed(n + k)
    codes = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x42  # the format's NaN: never a weight
    codes[0, :16] = torch.arange(16, dtype=torch.uint8)  # zero and the subnormals
    codes[1, :16] = torch.arange(16, dtype=torch.uint8) | 0x80
    codes[1, -5:] = torch.tensor([0x81, 0xC0, 0x85, 0xB7, 0x80], dtype=torch.uint8)  # the tail
    wf = codes.view(torch.float8_e4m3fn).to(torch.float64)
    if scale == "tensor":
        t = {"weight_scale": torch.tensor([0.03])}
        w = wf * 0.03
        method = FP8("tensor")
    elif scale == "channel":
        s = torch.rand(n, 1, generator=gen) * 0.05
        t = {"weight_scale": s}
        w = wf * s.double()
        method = FP8("channel")
    else:
        s = torch.rand(n // 16, k // 32, generator=gen) * 0.05
        t = {"weight_scale_inv": s}
        w = wf * s.double().repeat_interleave(16, 0).repeat_interleave(32, 1)
        method = FP8("block", (16, 32))
    t["weight"] = codes.view(torch.float8_e4m3fn)
    iw = IntWeight(method, t, {"": (0, n)}, n, k)
    x = torch.randn(5, k, generator=gen)
    assert iw._kernel(x) is not None
    torch.testing.assert_close(iw.matmul(x).double(), x.double() @ w.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(iw.dequantize(slice(0, n)).double(), w, rtol=1e-6, atol=0)
