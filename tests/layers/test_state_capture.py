"""State checkpoints captured inside the kernels (pagefold.ops.common.capture).

Each kernel of the GDN and SSD triples, given ``capture=(after, out)``, must write into
``out[m]`` the state a call cut right after token ``after[m]`` returns, and leave its own
outputs and final states untouched; the conv helper must return the window such a cut call
leaves behind.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagefold.ops.conv1d.reference import causal_conv1d_state_at, causal_conv1d_varlen
from pagefold.ops.gdn.reference import GDN_KERNELS
from pagefold.ops.ssd.reference import SSD_KERNELS

LENGTHS = [1, 7, 33, 64, 0, 65, 130, 40]
# Flat indices: first/last token of sequences, chunk-aligned and unaligned boundaries,
# two captures in one sequence, and a repeated one.
AFTER = [0, 4, 8 + 15, 8 + 32, 41 + 63, 105 + 20, 105 + 64, 170 + 16, 170 + 47, 170 + 129,
         300 + 5, 300 + 39, 300 + 39]


def _cu(lengths):
    return torch.tensor([0, *lengths], dtype=torch.long).cumsum(0)


def _seq(a: int) -> int:
    cu = _cu(LENGTHS).tolist()
    return next(s for s in range(len(LENGTHS)) if cu[s] <= a < cu[s + 1])


def _gdn_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    t, n, h, dk, dv = sum(LENGTHS), len(LENGTHS), 4, 16, 24
    q, k = torch.randn(t, h, dk, generator=gen), torch.randn(t, h, dk, generator=gen)
    v = torch.randn(t, h, dv, generator=gen)
    g = -F.softplus(torch.randn(t, h, generator=gen))
    beta = torch.rand(t, h, generator=gen)
    return (q, k, v, g, beta, torch.randn(n, h, dk, dv, generator=gen)), {}


def _ssd_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    t, n, h, p, g_, nn = sum(LENGTHS), len(LENGTHS), 4, 8, 2, 16
    args = (torch.randn(t, h, p, generator=gen), torch.randn(t, h, generator=gen),
            -(torch.rand(h, generator=gen) + 0.05), torch.randn(t, g_, nn, generator=gen) * 0.5,
            torch.randn(t, g_, nn, generator=gen) * 0.5, torch.randn(h, generator=gen),
            torch.randn(n, h, p, nn, generator=gen))
    return args, {"dt_bias": torch.randn(h, generator=gen) * 0.5}


def _cut(args, a):
    """Arguments of a call over sequence _seq(a) alone, ending right after token a."""
    s, cu = _seq(a), _cu(LENGTHS).tolist()
    per_token = [x[cu[s] : a + 1] if x.shape[0] == sum(LENGTHS) else x for x in args[:-1]]
    return (*per_token, args[-1][s : s + 1], torch.tensor([0, a + 1 - cu[s]]))


FAMILIES = {"gdn": (GDN_KERNELS, _gdn_inputs), "ssd": (SSD_KERNELS, _ssd_inputs)}


@pytest.mark.parametrize("family", ["gdn", "ssd"])
@pytest.mark.parametrize("kernel", ["naive", "chunked", "recurrent"])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_capture_equals_a_call_cut_there(family, kernel, chunk_size):
    kernels, make = FAMILIES[family]
    fn = kernels[kernel]
    args, kw = make(chunk_size)
    cu = _cu(LENGTHS)
    after = torch.tensor(AFTER)
    out = torch.full((len(AFTER), *args[-1].shape[1:]), float("nan"))
    y, final = fn(*args, cu, chunk_size=chunk_size, capture=(after, out), **kw)
    y0, final0 = fn(*args, cu, chunk_size=chunk_size, **kw)
    # Captures change nothing else: same outputs and final states (to rounding: GDN's chunked
    # kernel re-chunks the padded sequences).
    torch.testing.assert_close(y, y0, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(final, final0, atol=2e-5, rtol=1e-5)
    for m, a in enumerate(AFTER):
        ref = kernels["naive"](*_cut(args, a), chunk_size=chunk_size, **kw)[1][0]
        torch.testing.assert_close(out[m], ref, atol=2e-5, rtol=1e-5, msg=f"capture {m}")


def test_chunked_capture_at_chunk_boundary_is_bitwise_the_cut_call():
    """A boundary on the chunk grid of a sequence starting the call: identical float ops."""
    args, _ = _gdn_inputs(3)
    cu = _cu(LENGTHS)
    after = torch.tensor([41 + 31, 170 + 63])  # boundaries 32 and 64 of sequences 3 and 6
    out = torch.empty(2, *args[-1].shape[1:])
    GDN_KERNELS["chunked"](*args, cu, chunk_size=32, capture=(after, out))
    for m, a in enumerate(after.tolist()):
        cut = GDN_KERNELS["chunked"](*_cut(args, a), chunk_size=32)[1][0]
        assert torch.equal(out[m], cut)


@pytest.mark.parametrize("family", ["gdn", "ssd"])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunked_captures_leave_the_chunking_alone(family, chunk_size):
    """Chunked captures (GDN and SSD) inside a chunk: the chunking is untouched (outputs and
    final states bitwise those of the call without captures), and a capture is the final
    state of a chunked call cut there: bitwise at a sequence's last token and where the target
    ends a chunk of a call that chunks alike, else to float32 rounding (a shorter call lands
    other elements in vectorised loops' scalar tails)."""
    kernels, make = FAMILIES[family]
    args, kw = make(5)
    cu = _cu(LENGTHS)
    after = torch.tensor(AFTER)
    out = torch.full((len(AFTER), *args[-1].shape[1:]), float("nan"))
    y, final = kernels["chunked"](*args, cu, chunk_size=chunk_size, capture=(after, out), **kw)
    y0, final0 = kernels["chunked"](*args, cu, chunk_size=chunk_size, **kw)
    assert torch.equal(y, y0) and torch.equal(final, final0)
    starts = cu.tolist()
    bitwise = 0
    for m, a in enumerate(AFTER):
        cut = kernels["chunked"](*_cut(args, a), chunk_size=chunk_size, **kw)[1][0]
        n = a + 1 - starts[_seq(a)]
        if family == "ssd" and n >= chunk_size and n % chunk_size == 0:
            assert torch.equal(out[m], cut), f"capture {m}"
            bitwise += 1
        torch.testing.assert_close(out[m], cut, atol=2e-6, rtol=2e-6, msg=f"capture {m}")
        if a + 1 == starts[_seq(a) + 1]:  # a sequence's last token: its final state
            assert torch.equal(out[m], final[_seq(a)]), f"capture {m}"
            bitwise += 1
    assert bitwise >= 2


def test_capture_rejects_bad_positions():
    args, _ = _gdn_inputs()
    with pytest.raises(ValueError, match="capture positions"):
        GDN_KERNELS["chunked"](*args, _cu(LENGTHS), capture=(torch.tensor([10_000]),
                                                               torch.empty(1, 4, 16, 24)))
    with pytest.raises(ValueError, match="capture out"):
        GDN_KERNELS["naive"](*args, _cu(LENGTHS), capture=(torch.tensor([1]),
                                                           torch.empty(2, 4, 16, 24)))


@pytest.mark.parametrize("kernel", [2, 4])
def test_conv_state_at_equals_cut_call(kernel):
    gen = torch.Generator().manual_seed(kernel)
    c = 12
    x = torch.randn(sum(LENGTHS), c, generator=gen).bfloat16()
    w = torch.randn(c, kernel, generator=gen)
    st = torch.randn(len(LENGTHS), c, kernel - 1, generator=gen).bfloat16()
    got = causal_conv1d_state_at(x, st, _cu(LENGTHS), torch.tensor(AFTER))
    cu = _cu(LENGTHS).tolist()
    for m, a in enumerate(AFTER):
        s = _seq(a)
        _, ref = causal_conv1d_varlen(x[cu[s] : a + 1], w, None, st[s : s + 1],
                                      torch.tensor([0, a + 1 - cu[s]]))
        assert torch.equal(got[m], ref[0]), m
