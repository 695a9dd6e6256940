"""Verify-pass state kernels: states after every token equal the plain kernels run on every
prefix, outputs equal the plain kernels, and select_states picks the accepted prefix.

The references are the naive (token by token) forms; the Mamba-1, lightning and KDA verify
forms step their recurrent (decode) forms, a separate implementation, and are reached through
the ops' entries with ``verify=True`` (what the layers call)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagefold.ops.conv1d import (
    causal_conv1d_naive,
    causal_conv1d_verify,
    causal_conv1d_verify_naive,
)
from pagefold.ops.gdn import gdn_naive, gdn_verify, gdn_verify_naive
from pagefold.ops.kda import kda, kda_naive
from pagefold.ops.lightning import lightning, lightning_naive
from pagefold.ops.selective_scan import selective_scan, selective_scan_naive
from pagefold.ops.ssd import ssd_naive, ssd_verify, ssd_verify_naive
from pagefold.spec_decode.state_verify import select_states

LENGTHS = [4, 1, 3, 4, 2]  # verify chunks of 1 + k tokens (k up to 3), mixed
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.long).cumsum(0)


def _prefix_states(run, tensors_t, state0, cu):
    """Per token t of sequence s: the plain kernel's final state over tokens cu[s]..t."""
    out = []
    b = cu.tolist()
    for s in range(len(b) - 1):
        for t in range(b[s], b[s + 1]):
            sl = slice(b[s], t + 1)
            out.append(run([x[sl] for x in tensors_t], state0[s : s + 1],
                           torch.tensor([0, t + 1 - b[s]]))[0])
    return torch.stack(out)


@pytest.mark.parametrize("fn", [causal_conv1d_verify, causal_conv1d_verify_naive])
@pytest.mark.parametrize("bias", [True, False])
def test_conv_verify(fn, bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    C, K = 6, 4
    cu = _cu(LENGTHS)
    x = torch.randn(int(cu[-1]), C, generator=g)
    w = torch.randn(C, K, generator=g)
    b = torch.randn(C, generator=g) if bias else None
    st = torch.randn(len(LENGTHS), C, K - 1, generator=g)
    y, states = fn(x, w, b, st, cu)
    y_ref, _ = causal_conv1d_naive(x, w, b, st, cu)
    torch.testing.assert_close(y, y_ref, **TOL)
    ref = _prefix_states(lambda ts, s0, c: causal_conv1d_naive(ts[0], w, b, s0, c)[1],
                         [x], st, cu)
    torch.testing.assert_close(states, ref, **TOL)
    acc = [3, 0, 1, 2, 0]
    torch.testing.assert_close(select_states(states, cu, acc),
                               states[cu[:-1] + torch.tensor(acc)])


def _gdn_inputs(total: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    H, DK, DV = 3, 8, 5
    q = torch.randn(total, H, DK, generator=g)
    k = torch.randn(total, H, DK, generator=g)
    v = torch.randn(total, H, DV, generator=g)
    gg = -F.softplus(torch.randn(total, H, generator=g))
    beta = torch.rand(total, H, generator=g)
    s0 = torch.randn(n, H, DK, DV, generator=g) * 0.3
    return q, k, v, gg, beta, s0


@pytest.mark.parametrize("fn", [gdn_verify, gdn_verify_naive])
def test_gdn_verify(fn) -> None:
    cu = _cu(LENGTHS)
    q, k, v, gg, beta, s0 = _gdn_inputs(int(cu[-1]), len(LENGTHS), 1)
    o, states = fn(q, k, v, gg, beta, s0, cu)
    o_ref, final = gdn_naive(q, k, v, gg, beta, s0, cu)
    torch.testing.assert_close(o, o_ref, **TOL)
    ref = _prefix_states(lambda ts, st, c: gdn_naive(*ts, st, c)[1], [q, k, v, gg, beta], s0, cu)
    torch.testing.assert_close(states, ref, **TOL)
    last = [n - 1 for n in LENGTHS]
    torch.testing.assert_close(select_states(states, cu, last), final, **TOL)


@pytest.mark.parametrize("fn", [ssd_verify, ssd_verify_naive])
def test_ssd_verify(fn) -> None:
    g = torch.Generator().manual_seed(2)
    cu = _cu(LENGTHS)
    T, H, P, G, N = int(cu[-1]), 4, 3, 2, 5
    x = torch.randn(T, H, P, generator=g)
    dt = torch.randn(T, H, generator=g)
    A = -torch.rand(H, generator=g) - 0.1
    B = torch.randn(T, G, N, generator=g)
    Cm = torch.randn(T, G, N, generator=g)
    D = torch.randn(H, generator=g)
    dt_bias = torch.randn(H, generator=g)
    s0 = torch.randn(len(LENGTHS), H, P, N, generator=g)
    y, states = fn(x, dt, A, B, Cm, D, s0, cu, dt_bias=dt_bias)
    y_ref, final = ssd_naive(x, dt, A, B, Cm, D, s0, cu, dt_bias=dt_bias)
    torch.testing.assert_close(y, y_ref, **TOL)
    ref = _prefix_states(
        lambda ts, st, c: ssd_naive(ts[0], ts[1], A, ts[2], ts[3], D, st, c, dt_bias=dt_bias)[1],
        [x, dt, B, Cm], s0, cu)
    torch.testing.assert_close(states, ref, **TOL)


def _check_stepwise(verify, naive, per_tok, shared_after, state0, lengths=LENGTHS) -> None:
    """``verify(*per_tok, *shared_after, state0, cu)`` against ``naive`` on every prefix:
    outputs, states after every token, and the final states at the last token."""
    cu = _cu(lengths)
    o, states = verify(*per_tok, *shared_after, state0, cu)
    o_ref, final = naive(*per_tok, *shared_after, state0, cu)
    torch.testing.assert_close(o, o_ref, **TOL)
    ref = _prefix_states(lambda ts, st, c: naive(*ts, *shared_after, st, c)[1], per_tok,
                         state0, cu)
    assert states.shape == (int(cu[-1]), *state0.shape[1:])
    torch.testing.assert_close(states, ref, **TOL)
    if min(lengths) > 0:  # select_states takes sequences with a token only
        last = [n - 1 for n in lengths]
        torch.testing.assert_close(select_states(states, cu, last), final, **TOL)


@pytest.mark.parametrize("with_z", [True, False])
@pytest.mark.parametrize("lengths", [LENGTHS, [1, 1, 1, 1, 1], [4, 0, 2, 1, 2]])
def test_selective_scan_verify(with_z: bool, lengths: list[int]) -> None:
    """Mamba-1 (Jamba, Mamba, Falcon-Mamba): x, dt, B, C, z per token; A, D, dt_bias shared."""
    g = torch.Generator().manual_seed(3)
    T, CH, N = sum(lengths), 6, 4
    x, dt, z = (torch.randn(T, CH, generator=g) for _ in range(3))
    A = -torch.rand(CH, N, generator=g) - 0.1
    B, C = torch.randn(T, N, generator=g), torch.randn(T, N, generator=g)
    D, dt_bias = torch.randn(CH, generator=g), torch.randn(CH, generator=g)
    s0 = torch.randn(len(lengths), CH, N, generator=g)

    def run(fn):  # the per-token inputs first, as _check_stepwise passes them
        def call(x, dt, B, C, *rest):
            *zz, st, cu = rest
            return fn(x, dt, A, B, C, D, zz[0] if zz else None, st, cu, dt_bias=dt_bias,
                      dt_softplus=True)
        return call

    def verify(*a, **kw):
        return selective_scan(*a, decode=False, verify=True, **kw)

    _check_stepwise(run(verify), run(selective_scan_naive),
                    [x, dt, B, C, *([z] if with_z else [])], [], s0, lengths)


def test_lightning_verify() -> None:
    """MiniMax: q, k, v per token; the per-head decay rate shared."""
    g = torch.Generator().manual_seed(4)
    T, H, DK, DV = sum(LENGTHS), 3, 4, 5
    q, k = torch.randn(T, H, DK, generator=g), torch.randn(T, H, DK, generator=g)
    v = torch.randn(T, H, DV, generator=g)
    slope = torch.rand(H, generator=g) + 0.05
    s0 = torch.randn(len(LENGTHS), H, DK, DV, generator=g)

    def verify(*a):
        return lightning(*a, decode=False, verify=True)

    _check_stepwise(verify, lightning_naive, [q, k, v], [slope], s0)


def test_kda_verify() -> None:
    """Kimi Linear: q, k, v, the per-channel decay g and beta per token."""
    g_ = torch.Generator().manual_seed(5)
    T, H, D = sum(LENGTHS), 2, 4
    q, k, v = (torch.randn(T, H, D, generator=g_) for _ in range(3))
    g = -F.softplus(torch.randn(T, H, D, generator=g_))
    beta = torch.rand(T, H, generator=g_)
    s0 = torch.randn(len(LENGTHS), H, D, D, generator=g_) * 0.3

    def verify(*a):
        return kda(*a, decode=False, verify=True)

    _check_stepwise(verify, kda_naive, [q, k, v, g, beta], [], s0)


def test_select_states_rejects_bad_counts() -> None:
    cu = _cu([2, 3])
    states = torch.zeros(5, 1)
    with pytest.raises(ValueError, match="num_accepted"):
        select_states(states, cu, [2, 0])
    with pytest.raises(ValueError, match="num_accepted"):
        select_states(states, cu, [0])
    with pytest.raises(ValueError, match=r"^num_accepted must be in \[0, len\) per sequence; "
                       r"got \[0, 3\] for lengths \[2, 3\]$"):
        select_states(states, cu, [0, 3])  # the second sequence has 3 tokens: 0..2
