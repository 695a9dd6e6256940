"""Lightning attention: the chunked and recurrent kernels against the naive reference."""

from __future__ import annotations

import pytest
import torch

from pagefold.models.minimax import lightning_slopes
from pagefold.ops.lightning.reference import (
    lightning_chunked,
    lightning_naive,
    lightning_recurrent,
)

H, DK, DV = 3, 6, 5


def _inputs(lens: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, k = torch.randn(t, H, DK, generator=g), torch.randn(t, H, DK, generator=g)
    v = torch.randn(t, H, DV, generator=g)
    state = torch.randn(len(lens), H, DK, DV, generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return q, k, v, lightning_slopes(H, 1, 4), state, cu


@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
def test_chunked_matches_naive(chunk: int) -> None:
    q, k, v, slope, state, cu = _inputs([17, 1, 40, 5])
    before = state.clone()
    want = lightning_naive(q, k, v, slope, state, cu)
    got = lightning_chunked(q, k, v, slope, state, cu, chunk_size=chunk)
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-4)
    assert torch.equal(state, before)


def test_recurrent_steps_equal_naive() -> None:
    q, k, v, slope, state, _ = _inputs([4, 4], seed=1)
    want = lightning_naive(q, k, v, slope, state, torch.tensor([0, 4, 8]))
    s, outs = state, []
    for step in range(4):
        rows = torch.tensor([step, 4 + step])
        o, s = lightning_recurrent(q[rows], k[rows], v[rows], slope, s, torch.arange(3))
        outs.append(o)
    torch.testing.assert_close(torch.stack(outs, 1).reshape(8, H, DV), want[0])
    torch.testing.assert_close(s, want[1])
    with pytest.raises(ValueError, match="one token per request"):
        lightning_recurrent(q, k, v, slope, state, torch.tensor([0, 8]))


def test_decay_and_slopes() -> None:
    """One head, zero state, k = v = q = 1: o_t = sum_{j<=t} exp(-s (t - j)); the last layer's
    rates are nearly zero (transformers' 1e-5 floor), the first's the largest."""
    slope = torch.tensor([0.5])
    ones = torch.ones(5, 1, 1)
    o, _ = lightning_chunked(ones, ones, ones, slope, torch.zeros(1, 1, 1, 1),
                             torch.tensor([0, 5]), chunk_size=2)
    want = torch.tensor([sum(torch.exp(torch.tensor(-0.5 * (t - j))).item()
                             for j in range(t + 1)) for t in range(5)])
    torch.testing.assert_close(o.flatten(), want)
    first, last = lightning_slopes(8, 0, 4), lightning_slopes(8, 3, 4)
    assert bool((first > last).all()) and float(last.max()) < 1e-4
