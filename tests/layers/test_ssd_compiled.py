"""The compiled chunked SSD scan (csrc/ssd.cpp via ``ssd_chunked``) against the definition,
and the compiled gate-first gated RMSNorm (csrc/gated_norm.cpp) against its torch form.

``ssd_chunked`` runs the kernel on the CPU when the kernels are on; these tests prove it ran
(a counting wrapper) and compare it with ``ssd_naive`` (the token recurrence) over varlen
batches, both input dtypes, head dims that take the vector product (multiples of 16, with
and without a 64-wide block) and the scalar one, and captures inside and at the end of
chunks; and check that ``compiled=False`` / kernels off give the torch form.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from pagefold.csrc import cpu_ops
from pagefold.ops.ssd import cpu as ssd_cpu
from pagefold.ops.ssd.reference import ssd_chunked, ssd_naive

pytestmark = pytest.mark.skipif(cpu_ops.kernels() is None, reason="no C++ compiler")

LENS = [1, 7, 33, 0, 64, 65, 130]


def _inputs(lens, H, P, G, N, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    T, S = sum(lens), len(lens)
    return dict(
        x=torch.randn(T, H, P, generator=g).to(dtype),
        dt=torch.randn(T, H, generator=g),
        A=-(torch.rand(H, generator=g) * 1.5 + 0.05),
        B=(torch.randn(T, G, N, generator=g) * 0.5).to(dtype),
        C=(torch.randn(T, G, N, generator=g) * 0.5).to(dtype),
        D=torch.randn(H, generator=g),
        initial_state=torch.randn(S, H, P, N, generator=g),
        cu_seqlens=torch.tensor([0, *itertools.accumulate(lens)]),
        dt_bias=torch.randn(H, generator=g) * 0.5,
    )


@pytest.fixture
def calls(monkeypatch):
    """Counts the kernel calls that returned a result."""
    n = [0]
    real = ssd_cpu.ssd_chunked_cpu

    def counting(*a, **k):
        res = real(*a, **k)
        n[0] += res is not None
        return res

    monkeypatch.setattr(ssd_cpu, "ssd_chunked_cpu", counting)
    return n


@pytest.mark.parametrize("P,G,N", [(8, 1, 16), (16, 2, 8), (80, 2, 16), (64, 4, 32), (10, 1, 6)])
@pytest.mark.parametrize("chunk", [16, 64])
def test_compiled_matches_naive(calls, P, G, N, chunk):
    inp = _inputs(LENS, H=4, P=P, G=G, N=N, seed=P + chunk)
    kw = dict(dt_min=0.01, dt_max=4.0, chunk_size=chunk)
    after = torch.tensor([0, 1 + 3, 8 + 15, 8 + 32, 41 + 63, 105 + 20, 105 + 64, 170 + 129,
                          170 + 63])
    outs = []
    for fn in (ssd_chunked, ssd_naive):
        cap = torch.empty(len(after), 4, P, N)
        y, h = fn(**inp, capture=(after, cap), **kw)
        outs.append((y, h, cap))
    assert calls[0] == 1
    for got, ref in zip(*outs, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("x_low,bc_low", [(True, True), (False, True), (True, False)])
def test_compiled_low_precision_inputs(calls, x_low, bc_low):
    """bf16 x and / or B, C (the mixer passes float32 x with bf16 B and C) are read as they
    are: the result is the float32 call's on the rounded values, y in x's dtype."""
    low = _inputs(LENS, H=4, P=32, G=2, N=16, seed=3, dtype=torch.bfloat16)
    up = dict(low, x=low["x"].float(), B=low["B"].float(), C=low["C"].float())
    mixed = dict(up, **({"x": low["x"]} if x_low else {}),
                 **({"B": low["B"], "C": low["C"]} if bc_low else {}))
    y, h = ssd_chunked(**mixed, chunk_size=32)
    y_ref, h_ref = ssd_naive(**up)
    assert calls[0] == 1 and y.dtype == mixed["x"].dtype
    torch.testing.assert_close(y.float(), y_ref, atol=2e-2 if x_low else 1e-4, rtol=1e-2)
    torch.testing.assert_close(h, h_ref, atol=1e-4, rtol=1e-4)


def test_strided_views_and_empty_batch(calls):
    """x, B, C as column slices of one (T, conv_dim) row (as the mixer passes them)."""
    inp = _inputs([40, 3], H=2, P=16, G=1, N=16, seed=4)
    T = 43
    row = torch.cat([inp["x"].reshape(T, -1), inp["B"].reshape(T, -1),
                     inp["C"].reshape(T, -1)], dim=1)
    xs, b, c = row.split([32, 16, 16], dim=1)
    strided = dict(inp, x=xs.view(T, 2, 16), B=b.view(T, 1, 16), C=c.view(T, 1, 16))
    y, h = ssd_chunked(**strided, chunk_size=16)
    y_ref, h_ref = ssd_naive(**inp)
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(h, h_ref, atol=1e-4, rtol=1e-4)
    empty = _inputs([0, 0], H=2, P=16, G=1, N=16, seed=5)
    y, h = ssd_chunked(**empty)
    assert y.shape == (0, 2, 16) and torch.equal(h, empty["initial_state"])
    assert calls[0] == 1  # the empty batch returns before the kernel


def test_torch_form_when_asked_or_kernels_off(calls):
    inp = _inputs(LENS, H=4, P=16, G=2, N=16, seed=6)
    y_t, h_t = ssd_chunked(**inp, compiled=False)
    assert calls[0] == 0
    cpu_ops.set_enabled(False)
    try:
        y_off, h_off = ssd_chunked(**inp)
    finally:
        cpu_ops.set_enabled(True)
    assert calls[0] == 0
    assert torch.equal(y_off, y_t) and torch.equal(h_off, h_t)
    y_c, h_c = ssd_chunked(**inp)
    assert calls[0] == 1
    torch.testing.assert_close(y_c, y_t, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtypes", [(torch.float32,) * 3, (torch.bfloat16,) * 3,
                                    (torch.float32, torch.bfloat16, torch.bfloat16)])
def test_gated_norm_kernel_matches_torch(monkeypatch, dtypes):
    """x / gate / weight dtypes as the mixers pass them (float32 model; bf16 decode; bf16
    prefill with float32 y); gate a column slice of wider rows; two groups."""
    from pagefold.layers.mamba import gated_norm
    from pagefold.layers.mamba.gated_norm import GatedRMSNorm

    n = [0]
    real = gated_norm.gated_norm_gate_first

    def counting(*a, **k):
        res = real(*a, **k)
        n[0] += res is not None
        return res

    monkeypatch.setattr(gated_norm, "gated_norm_gate_first", counting)
    gen = torch.Generator().manual_seed(2)
    xd, gd, wd = dtypes
    norm = GatedRMSNorm(64, 1e-5, group_size=32).to(wd)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(64, generator=gen))
    x = torch.randn(9, 64, generator=gen).to(xd)
    gate = torch.randn(9, 100, generator=gen).to(gd)[:, 20:84]
    got = norm(x, gate)
    assert n[0] == 1 and got.dtype == xd
    cpu_ops.set_enabled(False)
    try:
        ref = norm(x, gate)
    finally:
        cpu_ops.set_enabled(True)
    assert n[0] == 1
    if xd == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    else:  # the same bf16 roundings: rare one-ulp flips only
        torch.testing.assert_close(got, ref, atol=2e-2, rtol=1e-2)
        assert (got == ref).float().mean() > 0.97


def _paged_view(state_shape, page_bytes, seed=0):
    """A state pool (conv + float32 SSM components) whose states span several pages, filled
    with random bytes; returns (view, page ids of 9 states on shuffled blocks)."""
    from pagefold.core.kv_cache_spec import StateComponent, StateSpec
    from pagefold.executor.cache_tensors import StateView

    spec = StateSpec(kind="mamba2", components=(
        StateComponent("conv", (24, 3), torch.bfloat16),
        StateComponent("ssm", state_shape, torch.float32)))
    pps = -(-spec.state_bytes // page_bytes)
    num_blocks = 9 * pps + 5
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 255, (num_blocks, page_bytes), dtype=torch.uint8, generator=g)
    ids = torch.randperm(num_blocks, generator=g)[: 9 * pps].view(9, pps)
    return StateView(raw, spec, pps), ids


@pytest.mark.parametrize("page_bytes", [4096, 1040], ids=["aligned-pages", "odd-pages"])
@pytest.mark.parametrize("compiled", [True, False])
def test_paged_captures_land_in_their_pages(calls, page_bytes, compiled):
    """``capture=(after, PagedOut)``: the captures land in the checkpoint pages, bit for bit
    the buffer capture of the same kernel form, crossing page boundaries (odd page sizes
    too), and no other byte of the pool moves (the conv component is left as it was)."""
    from pagefold.ops.common.capture import PagedOut

    inp = _inputs(LENS, H=4, P=16, G=2, N=16, seed=8)
    after = torch.tensor([0, 1 + 3, 8 + 15, 8 + 32, 41 + 63, 105 + 20, 105 + 64, 170 + 129,
                          170 + 63])
    kw = dict(chunk_size=32, compiled=compiled)
    cap = torch.empty(len(after), 4, 16, 16)
    y_ref, h_ref = ssd_chunked(**inp, capture=(after, cap), **kw)
    view, ids = _paged_view((4, 16, 16), page_bytes)
    before = view.raw.clone()
    y, h = ssd_chunked(**inp, capture=(after, view.paged(ids, "ssm")), **kw)
    assert calls[0] == (2 if compiled else 0)
    assert torch.equal(y, y_ref) and torch.equal(h, h_ref)
    assert torch.equal(view.gather(ids)["ssm"], cap)
    # Only the SSM byte range of the captured states changed.
    mask = torch.zeros(view.raw.shape, dtype=torch.bool)
    off, nbytes = view.offset("ssm"), view.spec.component("ssm").nbytes
    for row in ids.tolist():
        flat = torch.zeros(len(row) * page_bytes, dtype=torch.bool)
        flat[off : off + nbytes] = True
        mask[row] = flat.view(len(row), page_bytes)
    assert torch.equal(view.raw[~mask], before[~mask])
    with pytest.raises(TypeError, match="PagedOut"):
        ssd_naive(**{k: v for k, v in inp.items() if k != "dt_bias"}, dt_bias=inp["dt_bias"],
                  capture=(after, PagedOut(view, ids, "ssm")))


@pytest.mark.parametrize("kernels", [True, False], ids=["compiled", "torch"])
@pytest.mark.parametrize("page_bytes", [4096, 1040])
def test_state_view_writes_components_and_zeroes_gaps(kernels, page_bytes):
    """``StateView.scatter`` writes each component in place (compiled ``pf_page_write`` or
    torch's per-page ``index_copy_``, the same bytes), zeroes the gaps, touches no other
    block, and insists on every component exactly once (given or ``written``)."""
    view, ids = _paged_view((4, 16, 16), page_bytes, seed=1)
    g = torch.Generator().manual_seed(2)
    states = {"conv": torch.randn(9, 24, 3, generator=g), "ssm": torch.randn(9, 4, 16, 16,
                                                                            generator=g)}
    before = view.raw.clone()
    cpu_ops.set_enabled(kernels)
    try:
        view.scatter(ids[2:7], {k: v[2:7] for k, v in states.items()})
        got = view.gather(ids[2:7])
        assert torch.equal(got["ssm"], states["ssm"][2:7])
        assert torch.equal(got["conv"], states["conv"][2:7].bfloat16())
        want = torch.zeros(ids.shape[1] * page_bytes, dtype=torch.uint8)
        for i, row in zip(range(2, 7), ids[2:7].tolist()):
            want.zero_()
            for c in view.spec.components:
                src = states[c.name][i].to(c.dtype).reshape(-1).view(torch.uint8)
                want[view.offset(c.name) : view.offset(c.name) + c.nbytes] = src
            assert torch.equal(view.raw[row].reshape(-1), want)
        untouched = sorted(set(range(view.raw.shape[0])) - set(ids[2:7].reshape(-1).tolist()))
        assert torch.equal(view.raw[untouched], before[untouched])
        # A kernel wrote the SSM itself: only the conv and the gaps are stored.
        view.scatter(ids[:1], {"conv": states["conv"][:1]}, written=("ssm",))
        assert torch.equal(view.gather(ids[:1])["conv"], states["conv"][:1].bfloat16())
        for bad in ({"conv": states["conv"][:1]}, ):
            with pytest.raises(ValueError, match="each of"):
                view.scatter(ids[:1], bad)
        with pytest.raises(ValueError, match="each of"):
            view.scatter(ids[:1], {k: v[:1] for k, v in states.items()}, written=("ssm",))
    finally:
        cpu_ops.set_enabled(True)
