"""``pf_qgemm_affine_q8`` (``csrc/qgemm_amx.cpp``: GGUF weights on int8 activations, AMX
tiles) against its definition in torch, on CPUs with AMX-INT8 (skipped elsewhere).

The definition: the activations rounded per row and group of 32 to ``d * round(x * 127 /
amax)`` (as ``pf_qgemv_affine_q8`` rounds them), times the weights decoded by gguf-py
(independent of pagefold), in float64; the kernel's float32 chain agrees to float32 rounding.
Every kept type (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K with its groups of 16), on awkward shapes:
outputs not a multiple of the 16-row strips, an odd number of groups, 1..33 rows (one and two
halves of 16 and a third), an all-zero group. The tile form's rows do not depend on the rows
beside them; below its least rows the kernel is ``pf_qgemv_affine_q8`` bit for bit; the
native driver's descriptor gives the module path's bits.
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
pytestmark = pytest.mark.skipif(lib is None or not lib.pf_qgemm_q8_takes(4, 32),
                                reason="no AMX-INT8 tile form on this CPU or build")

ROWS = [1, 5, 16, 17, 33]


def _raw(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    if kind.endswith("_K"):  # gguf-py cannot quantize K types: random blocks
        return _k_blocks(kind, n, k, rng)
    w = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
    w[:, :16] += 0.3  # Q4_1 mins away from -scale * 8
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])


def _weight(kind: str, n: int, k: int, seed: int):
    from pagefold.quantization.gguf_kernel import GGUFWeight

    raw = _raw(kind, n, k, np.random.default_rng(seed))
    dense = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(-1, k)
    return GGUFWeight([(kind, torch.from_numpy(raw))], k), torch.from_numpy(dense).double()


def _q8_rows(x: torch.Tensor) -> torch.Tensor:
    """Per row and group of 32: amax / 127 times round-half-even(x * (127 / amax)), float32
    arithmetic, zero for an all-zero group."""
    g = x.reshape(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    q = torch.where(amax > 0, torch.round(g * (127.0 / amax)), torch.zeros_like(g))
    return (q.double() * (amax / 127.0).double()).reshape(x.shape)


def _call(fn, weight, x: torch.Tensor, nthreads: int = 2) -> torch.Tensor:
    y = torch.full((x.shape[0], weight.n), float("nan"))
    rc = fn(x.data_ptr(), x.shape[0], weight.k, weight.n, weight.codes.data_ptr(),
            weight.q8_bits, weight.group, weight.scale.data_ptr(), weight.min.data_ptr(),
            int(weight.scale.dtype == torch.float16), y.data_ptr(), weight.n, nthreads)
    assert rc == 0
    return y


@pytest.fixture
def tiles_from_one_row():
    """The tile form at every row count (restored after)."""
    old = lib.pf_qgemm_q8_from(1)
    yield old
    lib.pf_qgemm_q8_from(old)


# (n, k): 37 outputs (two strips and 5 rows), 3 groups of 32 / 3 super-blocks of 256
@pytest.mark.parametrize("kind, n, k", [("Q4_0", 37, 96), ("Q4_1", 37, 96), ("Q8_0", 21, 160),
                                        ("Q4_K", 37, 768), ("Q5_K", 19, 256),
                                        ("Q6_K", 37, 256)])
def test_tile_product_is_its_definition(kind, n, k, tiles_from_one_row):
    weight, dense = _weight(kind, n, k, seed=n + k)
    assert weight.group == (16 if kind == "Q6_K" else 32)
    x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(k))
    x[0, :32] = 0  # an all-zero group: d = 0
    x[3, 32:64] *= 1e-3  # a small group beside large ones
    for m in ROWS:
        xm = x[:m].contiguous()
        want = _q8_rows(xm) @ dense.T
        got = _call(lib.pf_qgemm_affine_q8, weight, xm)
        err = (got.double() - want).abs().max().item()
        assert err <= 2e-6 * max(1.0, want.abs().max().item()), (m, err)
    # a row's bits do not depend on the rows beside it, nor on the threads
    full = _call(lib.pf_qgemm_affine_q8, weight, x, 2)
    for r in (0, 16, 32):
        alone = _call(lib.pf_qgemm_affine_q8, weight, x[r:r + 1].contiguous(), 1)
        assert torch.equal(alone, full[r:r + 1])
    shifted = _call(lib.pf_qgemm_affine_q8, weight, x[7:30].contiguous(), 1)
    assert torch.equal(shifted, full[7:30])


def test_fewer_rows_than_the_tile_form_takes_are_the_q8_gemv():
    weight, _ = _weight("Q4_1", 40, 128, seed=1)
    least = lib.pf_qgemm_q8_from(2)
    lib.pf_qgemm_q8_from(least)
    assert least >= 2
    x = torch.randn(least, 128)
    for m in range(1, least):
        xm = x[:m].contiguous()
        assert torch.equal(_call(lib.pf_qgemm_affine_q8, weight, xm),
                           _call(lib.pf_qgemv_affine_q8, weight, xm))
    # from the least rows on, the tile form: another summation order, not the GEMV's bits
    assert not torch.equal(_call(lib.pf_qgemm_affine_q8, weight, x),
                           _call(lib.pf_qgemv_affine_q8, weight, x))


def test_refuses_what_it_does_not_take():
    weight, _ = _weight("Q4_0", 16, 64, seed=0)
    x = torch.randn(2, 64)
    y = torch.empty(2, 16)

    def call(k, bits, group, m=2):
        return lib.pf_qgemm_affine_q8(x.data_ptr(), m, k, 16, weight.codes.data_ptr(), bits,
                                      group, weight.scale.data_ptr(), weight.min.data_ptr(), 1,
                                      y.data_ptr(), 16, 1)
    assert call(48, 4, 32) == 1  # 1.5 groups of 32
    assert call(64, 4, 16) == 1  # 4-bit codes come in groups of 32
    assert call(64, 3, 32) == 1
    assert call(64, 4, 64) == 1
    assert call(64, 4, 32, m=65) == 1  # more rows than any product takes
    assert not lib.pf_qgemm_q8_takes(4, 16) and not lib.pf_qgemm_q8_takes(9, 32)


@pytest.mark.parametrize("kind", ["Q4_1", "Q6_K"])
def test_native_descriptor_is_the_module_path(kind, tiles_from_one_row):
    k, n = 256, 40
    weight, _ = _weight(kind, n, k, seed=3)
    weight.choice = ("q8mm", 32)
    desc, fn = weight.native()
    gemv = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                            ctypes.c_int64, ctypes.c_int64, ctypes.c_int)(fn)
    bias = torch.randn(n).bfloat16()
    for m in (1, 17, 32):
        x = torch.randn(m, k + 8).bfloat16()[:, :k]  # a row stride beyond the row
        y = torch.empty((m, n), dtype=torch.bfloat16)
        assert gemv(x.data_ptr(), x.stride(0), ctypes.addressof(desc), bias.data_ptr(),
                    y.data_ptr(), n, m, n, k, 2) == 0
        want = weight.matmul(x) + bias
        assert torch.equal(y, want)
        assert torch.equal(weight.matmul(x), weight.product(x, "q8mm").bfloat16())
