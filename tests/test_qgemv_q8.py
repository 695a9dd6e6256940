"""The quantized few-row products on bf16 rows, and the native decode driver's GEMV for them.

* ``pf_qgemv_affine_q8`` (``csrc/qgemv_q8.cpp``: GGUF weights on int8 activations), every
  compiled form (AVX-512 VNNI; AVX2 for codes of at most 6 bits) and every type (Q4_0, Q4_1,
  Q8_0, Q4_K, Q5_K, Q6_K with its groups of 16, a fused Q4_K + Q6_K weight), against its
  definition in torch: the activations rounded per row and group of 32 to ``d * round(x * 127
  / amax)``, times the weights decoded by gguf-py (independent of pagefold), in float64; rows
  1, 3, 17, 32, an odd number of groups, an odd number of outputs, an all-zero group. A row's
  result does not depend on the rows beside it.
* ``pf_linear_quant`` (``csrc/quant_linear.cpp``, the driver's GEMV for a quantized matrix)
  gives the module path's bits: each format's own ``matmul`` on bf16 rows plus its bf16 bias.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pagefold.csrc import cpu_ops

sys.path.insert(0, str(Path(__file__).parent))
from gguf_files import _k_blocks  # noqa: E402

lib = cpu_ops.kernels()
pytestmark = pytest.mark.skipif(lib is None, reason="no compiled kernels")

KINDS = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
ROWS = [1, 3, 17, 32]


def _dense(kind: str, raw: np.ndarray, k: int) -> torch.Tensor:
    return torch.from_numpy(
        gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(-1, k)).double()


def _q8_rows(x: torch.Tensor) -> torch.Tensor:
    """The activations as the kernel rounds them: per row and group of 32, amax / 127 times
    round-half-even(x * (127 / amax)) (float32 arithmetic), zero for an all-zero group."""
    g = x.reshape(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    q = torch.where(amax > 0, torch.round(g * (127.0 / amax)), torch.zeros_like(g))
    return (q.double() * (amax / 127.0).double()).reshape(x.shape)


def _forms(bits: int, group: int) -> list[int]:
    """The isa limits under which a compiled form takes ``bits``-bit codes in ``group``s."""
    out = []
    for limit in (0, 1):
        old = lib.pf_qgemv_q8_limit_isa(limit)
        if lib.pf_qgemv_q8_takes(bits, group):
            out.append(limit)
        lib.pf_qgemv_q8_limit_isa(old)
    return out


def _weight(kind: str, n: int, k: int, seed: int):
    from pagefold.quantization.gguf_kernel import GGUFWeight

    rng = np.random.default_rng(seed)
    parts = []
    for one in kind.split("+"):  # "Q4_K+Q6_K": a fused weight, n rows each
        if one.endswith("_K"):
            raw = _k_blocks(one, n, k, rng)
        else:
            w = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
            w[:, :16] += 0.3  # Q4_1 mins away from -scale * 8
            raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[one])
        parts.append((one, raw))
    weight = GGUFWeight([(one, torch.from_numpy(raw)) for one, raw in parts], k)
    return weight, torch.cat([_dense(one, raw, k) for one, raw in parts])


def _q8(weight, x: torch.Tensor, nthreads: int = 2) -> torch.Tensor:
    y = torch.empty((x.shape[0], weight.n), dtype=torch.float32)
    rc = lib.pf_qgemv_affine_q8(x.data_ptr(), x.shape[0], weight.k, weight.n,
                                weight.codes.data_ptr(), weight.q8_bits, weight.group,
                                weight.scale.data_ptr(), weight.min.data_ptr(),
                                int(weight.scale.dtype == torch.float16), y.data_ptr(), weight.n,
                                nthreads)
    assert rc == 0
    return y


SHAPES = [(37, 96), (64, 576), (5, 32)]  # the 32-blocks' (n, k): odd groups, odd outputs
K_SHAPES = [(37, 768), (5, 256)]  # super-blocks of 256


@pytest.mark.parametrize("kind, n, k", [(t, n, k) for t in KINDS
                                        for n, k in (K_SHAPES if t.endswith("_K") else SHAPES)]
                         + [("Q4_K+Q6_K", 19, 512)])
def test_q8_kernel_is_its_definition(kind, n, k):
    weight, dense = _weight(kind, n, k, seed=n + k)
    assert weight.group == (16 if "Q6_K" in kind else 32)
    forms = _forms(weight.q8_bits, weight.group)
    if not forms:
        pytest.skip("no int8-activation form for these codes on this CPU")
    for limit in forms:
        old = lib.pf_qgemv_q8_limit_isa(limit)
        try:
            for m in ROWS:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                x[0, :32] = 0  # an all-zero group: d = 0
                want = _q8_rows(x) @ dense.T
                got = _q8(weight, x)
                err = (got.double() - want).abs().max().item()
                assert err <= 2e-6 * max(1.0, want.abs().max().item()), (limit, m, err)
                # the last row alone: the same bits as beside the others
                assert torch.equal(_q8(weight, x[m - 1:].contiguous(), 1), got[m - 1:])
        finally:
            lib.pf_qgemv_q8_limit_isa(old)


def test_q8_kernel_refuses_what_it_does_not_take():
    weight, _ = _weight("Q4_0", 8, 64, seed=0)
    x = torch.randn(2, 64)
    y = torch.empty(2, 8)
    args = (weight.codes.data_ptr(), 8, 16, weight.scale.data_ptr(), weight.min.data_ptr(), 1,
            y.data_ptr(), 8, 1)
    assert lib.pf_qgemv_affine_q8(x.data_ptr(), 2, 48, 8, *args) == 1  # k 48: 1.5 groups of 32
    args = (weight.codes.data_ptr(), 4, 64, weight.scale.data_ptr(), weight.min.data_ptr(), 1,
            y.data_ptr(), 8, 1)
    assert lib.pf_qgemv_affine_q8(x.data_ptr(), 2, 64, 8, *args) == 1  # group 64
    args = (weight.codes.data_ptr(), 3, 32, weight.scale.data_ptr(), weight.min.data_ptr(), 1,
            y.data_ptr(), 8, 1)
    assert lib.pf_qgemv_affine_q8(x.data_ptr(), 2, 64, 8, *args) == 1  # 3-bit codes
    assert not lib.pf_qgemv_q8_takes(4, 64) and not lib.pf_qgemv_q8_takes(9, 32)


def _linear_quant(desc_fn, x: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    desc, fn = desc_fn
    y = torch.empty((x.shape[0], n), dtype=torch.bfloat16)
    gemv = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                            ctypes.c_int64, ctypes.c_int64, ctypes.c_int)(fn)
    rc = gemv(x.data_ptr(), x.stride(0), ctypes.addressof(desc),
              bias.data_ptr() if bias is not None else None, y.data_ptr(), n, x.shape[0], n,
              x.shape[1], 2)
    assert rc == 0
    return y


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q6_K"])
def test_linear_quant_is_the_gguf_module_path(kind):
    from pagefold.quantization.gguf_kernel import GGUFWeight

    k = 512
    rng = np.random.default_rng(3)
    if kind.endswith("_K"):
        raw = _k_blocks(kind, 40, k, rng)
    else:
        raw = gguf.quants.quantize((rng.standard_normal((40, k)) * 0.1).astype(np.float32),
                                   gguf.GGMLQuantizationType[kind])
    weight = GGUFWeight([(kind, torch.from_numpy(raw))], k)
    bias = torch.randn(40).bfloat16()
    for m in ROWS:
        wide = torch.randn(m, k + 8).bfloat16()
        x = wide[:, :k]  # a row stride beyond the row
        want = weight.matmul(x) + bias
        assert torch.equal(_linear_quant(weight.native(), x, bias, 40), want)
        assert torch.equal(_linear_quant(weight.native(), x, None, 40), weight.matmul(x))


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_linear_quant_is_the_int_module_path(kind):
    from pagefold.quantization.int_kernel import IntWeight
    from pagefold.quantization.linear import quantize_weight

    w = torch.randn(48, 256) * 0.05
    method, tensors = quantize_weight(w, kind)
    weight = IntWeight(method, tensors, {"": (0, 48)}, 48, 256)
    bias = torch.randn(48).bfloat16()
    for m in ROWS:
        x = torch.randn(m, 256).bfloat16()
        assert torch.equal(_linear_quant(weight.native(), x, bias, 48), weight.matmul(x) + bias)
