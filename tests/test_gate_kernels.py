"""The small kernels of the native decode step against torch: ``pf_relu2`` (Nemotron-H's
relu^2 MLP, bit for bit torch's), ``pf_sigmoid_gate`` (gated attention's output gate, through
:func:`pagefold.ops.elementwise.sigmoid_gate`), ``pf_moe_route`` and
``pf_moe_shared_add`` (a sparse MoE block's router and shared-expert add). The module path and
the native decode step share the last three, whose exp is the kernels' own: torch's bits up to
rare one-step rounding flips."""

from __future__ import annotations

import pytest
import torch

from pagefold.csrc import cpu_ops
from pagefold.layers import activations
from pagefold.ops.elementwise import sigmoid_gate

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
    ref = activations.relu2(x[:, :inter].clone())
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
    _mostly_equal(got, ref, 5e-3)
    assert torch.equal(got[0, :3], ref[0, :3])


def test_sigmoid_gate_other_dtypes_are_torchs():
    gate = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(5))
    o = torch.randn(3, 16)
    assert torch.equal(sigmoid_gate(o, gate), o * torch.sigmoid(gate.reshape(3, -1)))


@pytest.mark.parametrize("norm", [True, False])
def test_moe_route_matches_torch(norm):
    """SparseMoeBlock's router on bf16 CPU logits (``pf_moe_route``): torch's experts, in
    torch.topk's order, and its weights up to rare one-step roundings."""
    from pagefold.layers.moe import _route_cpu

    g = torch.Generator().manual_seed(6)
    logits = (torch.randn(13, 24, generator=g) * 3).to(torch.bfloat16)
    w, idx = _route_cpu(logits, 5, norm)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    ref_w, ref_idx = torch.topk(probs, 5, dim=-1)
    if norm:
        ref_w = ref_w / ref_w.sum(dim=-1, keepdim=True)
    # The same experts in the same order up to ties (equal bf16 logits; torch.topk leaves
    # their order open, the kernel puts the lower expert first).
    assert torch.equal(probs.gather(1, idx), probs.gather(1, ref_idx))
    assert torch.equal(idx.sort(dim=1).values, ref_idx.sort(dim=1).values)
    ties = (probs.gather(1, idx)[:, 1:] == probs.gather(1, idx)[:, :-1])
    assert ties.any()  # this seed has one: check it went to the lower expert
    for i, j in ties.nonzero().tolist():
        assert idx[i, j] < idx[i, j + 1]
    assert w.dtype == torch.bfloat16
    _mostly_equal(w, ref_w.to(torch.bfloat16), 0.05)


@pytest.mark.parametrize("gated", [True, False])
def test_moe_shared_add_matches_torch(gated):
    """``out + sigmoid(gate) * shared`` (``pf_moe_shared_add``) rounded as torch rounds it."""
    from pagefold.layers.moe import _shared_add_cpu

    g = torch.Generator().manual_seed(7)
    out = torch.randn(6, 77, generator=g).to(torch.bfloat16)
    shared = torch.randn(6, 77, generator=g).to(torch.bfloat16)
    gate = (torch.randn(6, 1, generator=g) * 4).to(torch.bfloat16) if gated else None
    ref = out + (torch.sigmoid(gate) * shared if gated else shared)
    got = _shared_add_cpu(out.clone(), shared, gate)
    if gated:
        _mostly_equal(got, ref, 0.02)
    else:
        assert torch.equal(got, ref)


def _mostly_equal(got: torch.Tensor, ref: torch.Tensor, max_frac: float) -> None:
    diff = got != ref
    assert diff.float().mean().item() <= max_frac, f"{int(diff.sum())} of {got.numel()} differ"
    if diff.any():
        assert ((got.float() - ref.float()).abs()[diff]
                / (ref.float().abs()[diff] + 1e-6)).max() < 2e-2


def test_moe_route_and_shared_add_split_over_threads_give_the_same_bits():
    """A long prefill's router and shared add split their tokens over the threads: the same
    bits as one thread (each thread has its own scratch rows)."""
    from pagefold.layers.moe import _route_cpu, _shared_add_cpu

    g = torch.Generator().manual_seed(8)
    logits = (torch.randn(900, 40, generator=g) * 3).to(torch.bfloat16)  # over the threshold
    out = torch.randn(900, 96, generator=g).to(torch.bfloat16)
    shared = torch.randn(900, 96, generator=g).to(torch.bfloat16)
    gate = torch.randn(900, 1, generator=g).to(torch.bfloat16)
    threads = torch.get_num_threads()
    got = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got.append((*_route_cpu(logits, 4, True), _shared_add_cpu(out.clone(), shared, gate)))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*got):
        assert torch.equal(a, b)
    # every row routed, not just a share: the chosen experts carry the top-4 probabilities
    # (compared by value, since bf16 logits tie often and the order among ties is free)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top = torch.topk(probs, 4, dim=-1).values
    torch.testing.assert_close(probs.gather(1, got[1][1]), top, rtol=1e-5, atol=1e-7)
