"""The Triton state steps (``pagefold.ops.{conv1d,gdn,ssd}.triton``) against the naive /
torch paths.

* In-kernel captures: the chunked Triton kernels' ``capture=`` equals the naive kernels'
  (first token, mid-chunk, chunk end, two in one chunk, a one-token sequence, an empty one,
  captures given out of order); at the layer level (states over 3 non-adjacent pages, fresh
  and continued requests, GQA / groups) the checkpoint pages hold the torch path's states:
  the conv window bytewise, the recurrent state to float32 rounding; captures change no
  output and no final state (bytewise), and nothing else in the pool.
* Verify: per-token outputs and states equal the torch verify kernels, the pages are only
  read (bytewise unchanged), from pages or from dense initial states (a drafter's pass).

Shapes are tiny: without CUDA the kernels run under Triton's interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from pagefold.core.kv_cache_spec import StateComponent, StateSpec  # noqa: E402
from pagefold.executor.cache_tensors import StateView  # noqa: E402
from pagefold.ops.common.triton import PagedState  # noqa: E402
from pagefold.ops.conv1d import causal_conv1d_verify  # noqa: E402
from pagefold.ops.conv1d.reference import causal_conv1d_naive, causal_conv1d_state_at  # noqa: E402
from pagefold.ops.conv1d.triton import conv_windows  # noqa: E402
from pagefold.ops.gdn import gdn_verify  # noqa: E402
from pagefold.ops.gdn.reference import gdn_naive  # noqa: E402
from pagefold.ops.gdn.triton import (
    gdn_layer,  # noqa: E402
    gdn_verify_layer,  # noqa: E402
)
from pagefold.ops.gdn.triton_chunked import gdn_chunked_triton  # noqa: E402
from pagefold.ops.ssd import ssd_verify  # noqa: E402
from pagefold.ops.ssd.reference import ssd_naive  # noqa: E402
from pagefold.ops.ssd.triton import (
    mamba_scan_layer,  # noqa: E402
    mamba_verify_layer,  # noqa: E402
)
from pagefold.ops.ssd.triton_chunked import ssd_chunked_triton  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = dict(atol=1e-4, rtol=1e-4) if DEV.type == "cuda" else dict(atol=2e-5, rtol=2e-5)
# Lengths 37, 1, 0, 20, 16.
CU = [0, 37, 38, 38, 58, 74]
# Flat capture tokens, out of order: seq 0 first token / mid chunk / end of the first
# 16-chunk / two in one chunk; the one-token seq; seq 3's 3rd and last token; seq 4's 16th.
AFTER = [15, 0, 5, 37, 40, 57, 20, 21, 73]


def _cu(lst=CU):
    return torch.tensor(lst, dtype=torch.int64, device=DEV)


NSEQ = len(CU) - 1


def _gdn_inputs(g, h=2, dk=12, dv=20, t=CU[-1], n=NSEQ):
    q, k = (torch.randn(t, h, dk, generator=g).to(DEV) for _ in range(2))
    v = torch.randn(t, h, dv, generator=g).to(DEV)
    gl = -torch.rand(t, h, generator=g).to(DEV) * 0.5
    beta = torch.rand(t, h, generator=g).to(DEV)
    s0 = torch.randn(n, h, dk, dv, generator=g).to(DEV)
    return q, k, v, gl, beta, s0


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_captures_equal_naive(chunk):
    g = torch.Generator().manual_seed(1)
    after = torch.tensor(AFTER, device=DEV)
    q, k, v, gl, beta, s0 = _gdn_inputs(g)
    got = torch.full((len(AFTER), *s0.shape[1:]), float("nan"), device=DEV)
    want = torch.empty_like(got)
    o, f = gdn_chunked_triton(q, k, v, gl, beta, s0, _cu(), chunk_size=chunk,
                              capture=(after, got))
    o0, f0 = gdn_naive(q, k, v, gl, beta, s0, _cu(), capture=(after, want))
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(o, o0, **TOL)
    torch.testing.assert_close(f, f0, **TOL)

    h, p, nst = 2, 6, 12
    t = CU[-1]
    x = torch.randn(t, h, p, generator=g).to(DEV)
    dt = torch.randn(t, h, generator=g).to(DEV)
    A = -torch.rand(h, generator=g).to(DEV) - 0.1
    B, C = (torch.randn(t, 1, nst, generator=g).to(DEV) for _ in range(2))
    D, bias = torch.randn(h, generator=g).to(DEV), torch.randn(h, generator=g).to(DEV)
    s0 = torch.randn(len(CU) - 1, h, p, nst, generator=g).to(DEV)
    got = torch.full((len(AFTER), h, p, nst), float("nan"), device=DEV)
    want = torch.empty_like(got)
    kw = dict(dt_bias=bias, dt_min=0.01, dt_max=3.0)
    y, f = ssd_chunked_triton(x, dt, A, B, C, D, s0, _cu(), chunk_size=chunk,
                              capture=(after, got), **kw)
    y0, f0 = ssd_naive(x, dt, A, B, C, D, s0, _cu(), capture=(after, want), **kw)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(y, y0, **TOL)
    torch.testing.assert_close(f, f0, **TOL)


def test_conv_windows_are_the_torch_windows_bytewise():
    """Windows after any token (the old window still partly inside for early tokens, a fresh
    sequence's zeros), in bf16, read through pages."""
    g = torch.Generator().manual_seed(2)
    n, c, kk = len(CU) - 1, 10, 4
    x = torch.randn(CU[-1], c, generator=g).to(DEV, torch.bfloat16)
    st = torch.randn(n, c, kk - 1, generator=g).to(DEV, torch.bfloat16)
    init = torch.tensor([True, True, True, False, True], device=DEV)
    after = torch.tensor(AFTER, device=DEV)
    seq = torch.searchsorted(_cu()[1:], after, right=True)
    out = torch.zeros(len(AFTER), c, kk - 1, dtype=torch.bfloat16, device=DEV)
    conv_windows(x, PagedState.dense(st), _cu(), init, after, seq, PagedState.dense(out), kk)
    ref = torch.where(init[:, None, None], st, 0)
    assert torch.equal(out, causal_conv1d_state_at(x, ref, _cu(), after))


# ----------------------------------------------------------------------- layer level
def _pool(components, g, n_pages=48, pps=3):
    spec = StateSpec(kind="test", components=tuple(components))
    per_page = -(-spec.state_bytes // pps)
    page_bytes = -(-per_page // 16) * 16  # rows split across pages, 16-byte aligned
    raw = torch.randint(0, 255, (n_pages, page_bytes), dtype=torch.uint8, generator=g)
    return StateView(raw.to(DEV), spec, pps)


def _fill(view, pages, init, g):
    st = {name: (torch.randn(x.shape, generator=g) * 0.5).to(DEV, x.dtype)
          for name, x in view.gather(pages).items()}
    view.scatter(pages, st)
    return {name: torch.where(init.view(-1, *[1] * (x.dim() - 1)), x, 0).float()
            for name, x in st.items()}


class _Case:
    """One state layer's pool (3-page states), its requests' pages and checkpoint pages."""

    def __init__(self, kind: str, dtype: torch.dtype, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.kind, self.dtype, self.kk = kind, dtype, 4
        n = len(CU) - 1
        if kind == "gdn":  # 2 key heads serving 4 value heads
            self.hk, self.h, self.dk, self.dv = 2, 4, 8, 6
            self.c = 2 * self.hk * self.dk + self.h * self.dv
            ssm = (self.h, self.dk, self.dv)
        else:  # Mamba-2: 4 heads in 2 groups
            self.h, self.p, self.gr, self.nst = 4, 3, 2, 5
            self.c = self.h * self.p + 2 * self.gr * self.nst
            ssm = (self.h, self.p, self.nst)
        self.view = _pool([StateComponent("conv", (self.c, self.kk - 1), dtype),
                           StateComponent("ssm", ssm, torch.float32)], g)
        ids = torch.randperm(self.view.raw.shape[0], generator=g).to(DEV)
        self.pages = ids[: 3 * n].view(n, 3)
        self.cap_pages = ids[3 * n : 3 * (n + len(AFTER))].view(-1, 3)
        self.init = torch.tensor([True, False, True, True, False], device=DEV)
        self.s0 = _fill(self.view, self.pages, self.init, g)
        t = CU[-1]
        self.x = torch.randn(t, self.c, generator=g).to(DEV, dtype)
        self.w = (torch.randn(self.c, self.kk, generator=g) * 0.5).to(DEV, dtype)
        if kind == "gdn":
            self.a, self.b = (torch.randn(t, self.h, generator=g).to(DEV, dtype)
                              for _ in range(2))
            self.alog = torch.rand(self.h, generator=g).to(DEV)
            self.dtb = torch.rand(self.h, generator=g).to(DEV)
        else:
            self.cb = torch.randn(self.c, generator=g).to(DEV, dtype)
            self.dt = torch.rand(t, self.h, generator=g).to(DEV)
            self.A = -torch.rand(self.h, generator=g).to(DEV)
            self.D = torch.randn(self.h, generator=g).to(DEV)

    def layer(self, capture=None, cu=None, pages=None, init=None):
        cu = _cu() if cu is None else cu
        pages = self.pages if pages is None else pages
        init = self.init if init is None else init
        if self.kind == "gdn":
            return gdn_layer(self.view, pages, init, cu, self.x, self.a, self.b, self.w,
                             self.alog, self.dtb, num_k_heads=self.hk, num_v_heads=self.h,
                             head_k_dim=self.dk, head_v_dim=self.dv, capture=capture)
        return mamba_scan_layer(self.view, pages, init, cu, self.x, self.w, self.cb, self.dt,
                                self.A, self.D, num_heads=self.h, head_dim=self.p,
                                n_groups=self.gr, state_size=self.nst, y_dtype=torch.float32,
                                capture=capture)

    def verify(self, initial=None):
        init = None if initial is not None else self.init
        if self.kind == "gdn":
            return gdn_verify_layer(self.view, self.pages, init, _cu(), self.x, self.a, self.b,
                                    self.w, self.alog, self.dtb, num_k_heads=self.hk,
                                    num_v_heads=self.h, head_k_dim=self.dk,
                                    head_v_dim=self.dv, initial=initial)
        return mamba_verify_layer(self.view, self.pages, init, _cu(), self.x, self.w, self.cb,
                                  self.dt, self.A, self.D, num_heads=self.h, head_dim=self.p,
                                  n_groups=self.gr, state_size=self.nst, initial=initial)

    def torch_inner(self, y):
        """The recurrent kernel's inputs from the conv output ``y``, as the torch path."""
        t = y.shape[0]
        if self.kind == "gdn":
            q, k, v = y.split([self.hk * self.dk, self.hk * self.dk, self.h * self.dv], -1)
            rep = self.h // self.hk
            q = q.reshape(t, self.hk, self.dk).repeat_interleave(rep, 1)
            k = k.reshape(t, self.hk, self.dk).repeat_interleave(rep, 1)
            gl = -self.alog.exp() * F.softplus(self.a.float() + self.dtb)
            return (q, k, v.reshape(t, self.h, self.dv), gl, self.b.sigmoid())
        xs, B, C = y.split([self.h * self.p, self.gr * self.nst, self.gr * self.nst], -1)
        return (xs.reshape(t, self.h, self.p), self.dt, self.A,
                B.reshape(t, self.gr, self.nst), C.reshape(t, self.gr, self.nst), self.D)


def _kernel(case, kernel, args, s0, **kw):
    if case.kind == "gdn":
        return kernel(*args, s0, _cu(), **kw)
    return kernel(*args, s0, _cu(), dt_bias=None, dt_softplus=False, **kw)


@pytest.mark.parametrize("kind", ["gdn", "mamba"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_captures_write_the_torch_checkpoints(kind, dtype):
    case = _Case(kind, dtype, seed=3)
    before = case.view.raw.clone()
    after = torch.tensor(AFTER, device=DEV)
    o = case.layer(capture=(after, case.cap_pages))
    assert o is not None
    got = case.view.gather(case.cap_pages)
    final = case.view.gather(case.pages)
    # The torch path: conv windows from the inputs, states from the naive kernel's capture.
    conv_ref = causal_conv1d_state_at(case.x, case.s0["conv"].to(dtype), _cu(), after)
    assert torch.equal(got["conv"], conv_ref)
    y, _ = causal_conv1d_naive(case.x, case.w, getattr(case, "cb", None), case.s0["conv"],
                               _cu(), "silu")
    ssm_ref = torch.empty_like(got["ssm"])
    naive = gdn_naive if kind == "gdn" else ssd_naive
    _kernel(case, naive, case.torch_inner(y.to(dtype)), case.s0["ssm"],
            capture=(after, ssm_ref))
    # bf16: the conv outputs round to bf16 on both paths, not always the same way.
    tol = TOL if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got["ssm"], ssm_ref, **tol)
    # Captures change no output, no final state, and no page but the checkpoints' (bytewise).
    case.view.raw.copy_(before)
    o_plain = case.layer()
    assert torch.equal(o, o_plain)
    for name, v in case.view.gather(case.pages).items():
        assert torch.equal(final[name], v), name
    rows = torch.ones(case.view.raw.shape[0], dtype=torch.bool, device=DEV)
    rows[case.cap_pages.reshape(-1)] = False
    rows[case.pages.reshape(-1)] = False
    assert torch.equal(case.view.raw[rows], before[rows])


@pytest.mark.parametrize("kind", ["gdn", "mamba"])
def test_decode_batch_with_captures_takes_the_chunked_kernel(kind):
    """A batch of single tokens with a capture: the capture is that request's final state."""
    case = _Case(kind, torch.float32, seed=4)
    cu = _cu([0, 1, 2])
    cap = (torch.tensor([1], device=DEV), case.cap_pages[:1])
    assert case.layer(capture=cap, cu=cu, pages=case.pages[:2], init=case.init[:2]) is not None
    got, fin = case.view.gather(case.cap_pages[:1]), case.view.gather(case.pages[1:2])
    for name in ("conv", "ssm"):
        torch.testing.assert_close(got[name], fin[name], **TOL)


@pytest.mark.parametrize("kind", ["gdn", "mamba"])
@pytest.mark.parametrize("dense", [False, True], ids=["pages", "dense-initial"])
def test_verify_pass_equals_torch_and_reads_only(kind, dense):
    case = _Case(kind, torch.float32, seed=5)
    before = case.view.raw.clone()
    initial = None
    if dense:  # a drafter's pass: initial states given, the pages not read at all
        g = torch.Generator().manual_seed(6)
        initial = {name: torch.randn(x.shape, generator=g).to(DEV) for name, x in
                   case.s0.items()}
        case.view.raw.zero_()
        before = case.view.raw.clone()
    res = case.verify(initial)
    assert res is not None
    out, states = res
    assert torch.equal(case.view.raw, before)  # nothing stored
    s0 = initial if dense else case.s0
    y, conv_ref = causal_conv1d_verify(case.x, case.w, getattr(case, "cb", None),
                                       s0["conv"], _cu(), "silu")
    assert torch.equal(states["conv"], conv_ref)
    verify = gdn_verify if kind == "gdn" else ssd_verify
    o0, ssm_ref = _kernel(case, verify, case.torch_inner(y), s0["ssm"])
    torch.testing.assert_close(out, o0, **TOL)
    torch.testing.assert_close(states["ssm"], ssm_ref, **TOL)
