"""The element-wise kernels of the native decode step against torch: ``pf_relu2`` (Nemotron-H's
relu^2 MLP, bit for bit torch's) and ``pf_sigmoid_gate`` (gated attention's output gate,
through :func:`pagefold.layers.attention_gate.sigmoid_gate`, which the module path and the
decode plans share: torch's bits up to rare one-step rounding flips of the exp)."""

from __future__ import annotations

import pytest
import torch

from pagefold.csrc import cpu_ops
from pagefold.layers import activations
from pagefold.layers.attention_gate import sigmoid_gate

pytestmark = pytest.mark.skipif(cpu_ops.kernels() is None, reason="no C++ compiler")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [96, 93])  # 93: the scalar tail of a vectorised loop
def test_relu2_is_torchs(dtype, inter):
    x = (torch.randn(9, inter + 7, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    x[0, :4] = torch.tensor([float("nan"), -0.0, -3.0, 1e20])  # NaN stays, overflow to inf
    out = torch.empty(9, inter, dtype=dtype)
    rc = cpu_ops.kernels().pf_relu2(1 if dtype == torch.bfloat16 else 0, x.data_ptr(),
                                    x.stride(0), out.data_ptr(), 9, inter,
                                    torch.get_num_threads())
    assert rc == 0
    ref = activations._relu2(x[:, :inter].clone())
    torch.testing.assert_close(out, ref, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("d", [64, 21])  # 21: partial vectors and a scalar tail per head
def test_sigmoid_gate_matches_torch(d):
    t, h = 11, 5
    g = torch.Generator().manual_seed(4)
    qg = (torch.randn(t, h, 2 * d, generator=g) * 5).to(torch.bfloat16)
    qg[0, 0, d:d + 3] = torch.tensor([-100.0, 100.0, 0.0])  # exp's overflow edges
    gate = qg[..., d:]  # the [query | gate] halves: heads 2 * d apart
    o = torch.randn(t, h * d, generator=g).to(torch.bfloat16)
    got = sigmoid_gate(o, gate)
    ref = o * torch.sigmoid(gate.reshape(t, -1))
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    diff = got != ref
    assert diff.float().mean().item() <= 5e-3, f"{int(diff.sum())} of {got.numel()} differ"
    if diff.any():
        assert ((got.float() - ref.float()).abs()[diff]
                / (ref.float().abs()[diff] + 1e-6)).max() < 2e-2
    assert torch.equal(got[0, :3], ref[0, :3])


def test_sigmoid_gate_other_dtypes_are_torchs():
    gate = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(5))
    o = torch.randn(3, 16)
    assert torch.equal(sigmoid_gate(o, gate), o * torch.sigmoid(gate.reshape(3, -1)))
