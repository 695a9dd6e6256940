"""Mamba-1 selective scan: the chunked and recurrent kernels against the naive reference."""

from __future__ import annotations

import pytest
import torch

from pagefold.ops.selective_scan.reference import (
    selective_scan_chunked,
    selective_scan_naive,
    selective_scan_recurrent,
)

CH, N = 12, 5


def _inputs(lens: list[int], seed: int = 0, gate: bool = True):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    x = torch.randn(t, CH, generator=g)
    dt = torch.randn(t, CH, generator=g)
    A = -torch.rand(CH, N, generator=g) * 2 - 0.1
    B, C = torch.randn(t, N, generator=g), torch.randn(t, N, generator=g)
    D = torch.randn(CH, generator=g)
    z = torch.randn(t, CH, generator=g) if gate else None
    state = torch.randn(len(lens), CH, N, generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return x, dt, A, B, C, D, z, state, cu, torch.randn(CH, generator=g)


@pytest.mark.parametrize("chunk", [1, 4, 7, 16])
@pytest.mark.parametrize("gate", [True, False])
def test_chunked_matches_naive(chunk: int, gate: bool) -> None:
    x, dt, A, B, C, D, z, state, cu, bias = _inputs([9, 1, 23, 4], gate=gate)
    state_before = state.clone()
    want = selective_scan_naive(x, dt, A, B, C, D, z, state, cu, dt_bias=bias)
    got = selective_scan_chunked(x, dt, A, B, C, D, z, state, cu, dt_bias=bias,
                                 chunk_size=chunk)
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-4)
    assert torch.equal(state, state_before)


def test_recurrent_matches_naive_and_chains() -> None:
    """Three decode steps of four requests equal one naive pass over the three tokens."""
    x, dt, A, B, C, D, z, state, _, bias = _inputs([3, 3, 3, 3], seed=1)
    want = selective_scan_naive(x, dt, A, B, C, D, z, state, torch.tensor([0, 3, 6, 9, 12]),
                                dt_bias=bias)
    h, ys = state, []
    one = torch.arange(5)
    for step in range(3):
        rows = torch.arange(4) * 3 + step
        y, h = selective_scan_recurrent(x[rows], dt[rows], A, B[rows], C[rows], D, z[rows], h,
                                        one, dt_bias=bias)
        ys.append(y)
    got = torch.stack(ys, 1).reshape(12, CH)
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, want[1], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="one token per request"):
        selective_scan_recurrent(x, dt, A, B, C, D, z, state, torch.tensor([0, 12]))


def test_no_softplus_and_zero_state() -> None:
    x, dt, A, B, C, D, z, state, cu, _ = _inputs([6, 2], seed=2)
    dt = dt.abs()
    zero = torch.zeros_like(state)
    want = selective_scan_naive(x, dt, A, B, C, None, None, zero, cu, dt_softplus=False)
    got = selective_scan_chunked(x, dt, A, B, C, None, None, zero, cu, dt_softplus=False,
                                 chunk_size=4)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    # The first output of each request sees only its own token: h = dt * B * x.
    torch.testing.assert_close(want[0][0], (dt[0] * x[0]) * (B[0] @ C[0]))
