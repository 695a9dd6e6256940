"""Kimi Delta Attention: the chunked and recurrent kernels against the naive reference."""

from __future__ import annotations

import pytest
import torch

from pagefold.ops.kda.reference import kda_chunked, kda_naive, kda_recurrent

H, DK, DV = 2, 6, 5


def _inputs(lens: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, k = torch.randn(t, H, DK, generator=g), torch.randn(t, H, DK, generator=g)
    v = torch.randn(t, H, DV, generator=g)
    gate = -torch.rand(t, H, DK, generator=g) * 0.5
    beta = torch.rand(t, H, generator=g)
    state = torch.randn(len(lens), H, DK, DV, generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return q, k, v, gate, beta, state, cu


@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_chunked_matches_naive(chunk: int) -> None:
    q, k, v, g, beta, state, cu = _inputs([11, 1, 21, 3])
    before = state.clone()
    want = kda_naive(q, k, v, g, beta, state, cu)
    got = kda_chunked(q, k, v, g, beta, state, cu, chunk_size=chunk)
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-4)
    assert torch.equal(state, before)


def test_recurrent_steps_equal_naive() -> None:
    q, k, v, g, beta, state, _ = _inputs([3, 3], seed=1)
    want = kda_naive(q, k, v, g, beta, state, torch.tensor([0, 3, 6]))
    s, outs = state, []
    for step in range(3):
        rows = torch.tensor([step, 3 + step])
        o, s = kda_recurrent(q[rows], k[rows], v[rows], g[rows], beta[rows], s, torch.arange(3))
        outs.append(o)
    torch.testing.assert_close(torch.stack(outs, 1).reshape(6, H, DV), want[0])
    torch.testing.assert_close(s, want[1])
    with pytest.raises(ValueError, match="one token per request"):
        kda_recurrent(q, k, v, g, beta, state, torch.tensor([0, 6]))


def test_per_channel_decay() -> None:
    """With beta = 0 the state only decays, each key channel by its own gate."""
    q, k, v, g, _, state, cu = _inputs([4], seed=2)
    _, s = kda_naive(q, k, v, g, torch.zeros(4, H), state, cu, use_qk_l2norm=False)
    torch.testing.assert_close(s, state * torch.exp(g.sum(0))[None, :, :, None])
