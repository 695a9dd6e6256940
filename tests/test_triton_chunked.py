"""The chunked (WY / state-space-duality) Triton prefill kernels against the naive kernels.

Awkward shapes: sequence lengths that are not multiples of the chunk (and an empty one and a
one-token one), several sequences, starting states or zeros, GQA head ratios, chunk grids
shifted by absolute start positions, states over several non-adjacent pages; the captured
per-chunk and per-token states against the naive per-token states. float32 (the interpreter's
bf16 ``tl.dot`` is wrong in Triton 3.9; the kernels take any dtype). Without CUDA the kernels
run under Triton's interpreter, so shapes are tiny.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from pagefold.core.kv_cache_spec import StateComponent, StateSpec  # noqa: E402
from pagefold.executor.cache_tensors import StateView  # noqa: E402
from pagefold.ops.common.triton import (  # noqa: E402
    PagedState,
    block_chunk,
    chunk_layout,
    prefill_chunk_size,
)
from pagefold.ops.conv1d.reference import causal_conv1d_naive  # noqa: E402
from pagefold.ops.gdn import gdn_verify_naive  # noqa: E402
from pagefold.ops.gdn.reference import gdn_naive  # noqa: E402
from pagefold.ops.gdn.triton import gdn_layer  # noqa: E402
from pagefold.ops.gdn.triton_chunked import gdn_chunked_paged, gdn_chunked_triton  # noqa: E402
from pagefold.ops.ssd import ssd_verify_naive  # noqa: E402
from pagefold.ops.ssd.reference import ssd_naive  # noqa: E402
from pagefold.ops.ssd.triton import mamba_scan_layer  # noqa: E402
from pagefold.ops.ssd.triton_chunked import ssd_chunked_triton  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Lengths 37, 1, 0, 80, 16: past one 64-chunk, a decode row, an empty row, exactly a chunk.
CU = [0, 37, 38, 38, 118, 134]
# On a GPU float32 tiles multiply as 3xTF32 (float32-level, not bit-equal to "ieee").
TOL = dict(atol=1e-4, rtol=1e-4) if DEV.type == "cuda" else dict(atol=2e-5, rtol=2e-5)
NSEQ = len(CU) - 1


def _cu(lst=CU):
    return torch.tensor(lst, dtype=torch.int64, device=DEV)


def _gdn_inputs(seed, h=2, dk=12, dv=20, t=CU[-1], n=NSEQ, hk=None):
    g = torch.Generator().manual_seed(seed)
    hk = hk or h
    q, k = (torch.randn(t, hk, dk, generator=g).to(DEV) for _ in range(2))
    v = torch.randn(t, h, dv, generator=g).to(DEV)
    gl = -torch.rand(t, h, generator=g).to(DEV) * 0.5
    beta = torch.rand(t, h, generator=g).to(DEV)
    s0 = torch.randn(n, h, dk, dv, generator=g).to(DEV)
    return q, k, v, gl, beta, s0


def _chunk_states_want(per_tok, offs, m, pos, c):
    """The naive per-token states at every chunk end of ``chunk_layout``'s rows: the last
    token of each chunk, the first chunk shortened to end on a multiple of ``c`` of the
    absolute positions ``pos``."""
    lens = [b - a for a, b in zip(CU[:-1], CU[1:])]
    pos = pos or [0] * len(lens)
    want = []
    for s, (n, a, p0) in enumerate(zip(lens, CU[:-1], pos)):
        if n == 0:
            continue
        ends = list(range(c - p0 % c, n, c)) + [n]
        assert int(offs[s]) == len(want)
        want += [per_tok[a + e - 1] for e in ends]
    assert len(want) == m
    return torch.stack(want)


# Per-token captures only with 16-token chunks: the interpreter's time is per op, and the
# replay is one step a row (the code is the same for any chunk length).
@pytest.mark.parametrize("chunk,l2,pos", [(64, True, None), (16, False, [5, 0, 3, 30, 16])])
def test_gdn_chunked_matches_naive_with_captures(chunk, l2, pos):
    q, k, v, gl, beta, s0 = _gdn_inputs(1)
    if not l2:  # unit keys: without the norm the delta rule diverges (|k|^2 beta > 2)
        k = k / k.norm(dim=-1, keepdim=True)
    t, h, dk, dv = q.shape[0], q.shape[1], q.shape[2], v.shape[2]
    start = torch.tensor(pos, device=DEV) if pos else None
    c = block_chunk(chunk)
    offs, m = chunk_layout(_cu(), c, start)
    chunks = torch.full((m, h, dk, dv), float("nan"), device=DEV)
    inter = torch.full((t, h, dk, dv), float("nan"), device=DEV) if c == 16 else None
    o, f = gdn_chunked_triton(q, k, v, gl, beta, s0, _cu(), use_qk_l2norm=l2, chunk_size=chunk,
                              start_pos=start, intermediate=inter, chunk_states=chunks)
    o0, f0 = gdn_naive(q, k, v, gl, beta, s0, _cu(), use_qk_l2norm=l2)
    torch.testing.assert_close(o, o0, **TOL)
    torch.testing.assert_close(f, f0, **TOL)
    _, per_tok = gdn_verify_naive(q, k, v, gl, beta, s0, _cu(), use_qk_l2norm=l2)
    if inter is not None:
        torch.testing.assert_close(inter, per_tok, **TOL)
    torch.testing.assert_close(chunks, _chunk_states_want(per_tok, offs, m, pos, c), **TOL)


def test_gdn_chunked_gqa_paged_fresh_and_continued():
    """GQA (4 value heads on 2 key heads) over a dense state as pages, with some sequences
    fresh (``has_initial_state`` False: their stored state is ignored); then the batch split
    in two calls equals one (the state carried through the pages)."""
    hk, h = 2, 4
    q, k, v, gl, beta, s0 = _gdn_inputs(2, h=h, hk=hk, dk=16, dv=8)
    init = torch.tensor([True, False, True, True, False], device=DEV)
    st = s0.clone()
    out = torch.empty_like(v)
    gdn_chunked_paged(q, k, v, gl, beta, PagedState.dense(st), _cu(), init, out, scale=0.3)
    rep = lambda x: x.repeat_interleave(h // hk, 1)  # noqa: E731
    ref0 = torch.where(init[:, None, None, None], s0, 0.0)
    o0, f0 = gdn_naive(rep(q), rep(k), v, gl, beta, ref0, _cu(), scale=0.3)
    torch.testing.assert_close(out, o0, **TOL)
    torch.testing.assert_close(st, f0, **TOL)
    # Two calls: the first 20 tokens of sequence 3 (and all of the others), then the rest.
    b = CU[3] + 20
    st2 = s0.clone()
    first = torch.cat([torch.arange(0, b), torch.arange(CU[4], CU[5])]).to(DEV)
    cu1 = _cu([0, 37, 38, 38, 58, 74])
    out1 = torch.empty_like(v[first])
    gdn_chunked_paged(q[first], k[first], v[first], gl[first], beta[first],
                      PagedState.dense(st2), cu1, init, out1, scale=0.3, chunk_size=16)
    rest = torch.arange(b, CU[4], device=DEV)
    pages = torch.tensor([[3]], device=DEV)
    out2 = torch.empty_like(v[rest])
    part = PagedState(st2.reshape(-1), pages, st2[0].numel(), 0)
    gdn_chunked_paged(q[rest], k[rest], v[rest], gl[rest], beta[rest], part,
                      _cu([0, CU[4] - b]), torch.tensor([True], device=DEV), out2, scale=0.3)
    torch.testing.assert_close(out1[:b], o0[:b], **TOL)
    torch.testing.assert_close(out1[b:], o0[CU[4] :], **TOL)
    torch.testing.assert_close(out2, o0[b : CU[4]], **TOL)
    torch.testing.assert_close(st2, f0, **TOL)


def _ssd_inputs(seed, h=2, p=6, gr=1, nst=12, t=CU[-1], n=NSEQ):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, p, generator=g).to(DEV)
    dt = torch.randn(t, h, generator=g).to(DEV)
    A = -torch.rand(h, generator=g).to(DEV) - 0.1
    B, C = (torch.randn(t, gr, nst, generator=g).to(DEV) for _ in range(2))
    D = torch.randn(h, generator=g).to(DEV)
    bias = torch.randn(h, generator=g).to(DEV)
    s0 = torch.randn(n, h, p, nst, generator=g).to(DEV)
    return x, dt, A, B, C, D, bias, s0


@pytest.mark.parametrize("chunk,with_d,pos", [(64, True, None), (16, False, [9, 2, 0, 17, 0])])
def test_ssd_chunked_matches_naive_with_captures(chunk, with_d, pos):
    x, dt, A, B, C, D, bias, s0 = _ssd_inputs(3)
    D = D if with_d else None
    t, h, p, nst = x.shape[0], x.shape[1], x.shape[2], B.shape[2]
    start = torch.tensor(pos, device=DEV) if pos else None
    c = block_chunk(chunk)
    offs, m = chunk_layout(_cu(), c, start)
    chunks = torch.full((m, h, p, nst), float("nan"), device=DEV)
    inter = torch.full((t, h, p, nst), float("nan"), device=DEV) if c == 16 else None
    kw = dict(dt_bias=bias, dt_min=0.01, dt_max=3.0)
    y, f = ssd_chunked_triton(x, dt, A, B, C, D, s0, _cu(), chunk_size=chunk, start_pos=start,
                              intermediate=inter, chunk_states=chunks, **kw)
    y0, f0 = ssd_naive(x, dt, A, B, C, D, s0, _cu(), **kw)
    torch.testing.assert_close(y, y0, **TOL)
    torch.testing.assert_close(f, f0, **TOL)
    _, per_tok = ssd_verify_naive(x, dt, A, B, C, D, s0, _cu(), **kw)
    if inter is not None:
        torch.testing.assert_close(inter, per_tok, **TOL)
    torch.testing.assert_close(chunks, _chunk_states_want(per_tok, offs, m, pos, c), **TOL)


def _view(components, pages_per_state, num_blocks):
    spec = StateSpec(kind="test", components=tuple(components))
    page_bytes = -(-spec.state_bytes // pages_per_state)
    page_bytes = -(-page_bytes // 16) * 16
    raw = torch.randint(0, 255, (num_blocks, page_bytes), dtype=torch.uint8, device=DEV)
    return StateView(raw, spec, pages_per_state)


def test_layers_take_the_chunked_kernels_for_prefill(monkeypatch):
    """``gdn_layer`` / ``mamba_scan_layer`` on a batch with a prefill chunk run the chunked
    kernels (states over 3 non-adjacent pages, some requests fresh) and match conv + naive."""
    from pagefold.ops.gdn import triton_chunked as gdn_chunked
    from pagefold.ops.ssd import triton_chunked as ssd_chunked

    calls = {"gdn": 0, "ssd": 0}
    for mod, name, key in ((gdn_chunked, "gdn_chunked_paged", "gdn"),
                           (ssd_chunked, "ssd_chunked_paged", "ssd")):
        real = getattr(mod, name)

        def counted(*a, _real=real, _key=key, **kw):
            calls[_key] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(mod, name, counted)
    g = torch.Generator().manual_seed(4)
    n, t, kk = len(CU) - 1, CU[-1], 4
    pages = torch.randperm(17, generator=g)[: n * 3].view(n, 3).to(DEV)
    init = torch.tensor([True, False, True, True, False], device=DEV)

    def fill(view):
        st = {name: torch.randn(x.shape, generator=g).to(DEV, x.dtype)
              for name, x in view.gather(pages).items()}
        view.scatter(pages, st)
        return {name: torch.where(init.view(-1, *[1] * (x.dim() - 1)), x, 0.0)
                for name, x in st.items()}

    # Gated DeltaNet, 2 key heads serving 4 value heads.
    hk, hv, dk, dv = 2, 4, 8, 6
    c = 2 * hk * dk + hv * dv
    view = _view([StateComponent("conv", (c, kk - 1), torch.float32),
                  StateComponent("ssm", (hv, dk, dv), torch.float32)], 3, 17)
    s0 = fill(view)
    mixed = torch.randn(t, c, generator=g).to(DEV)
    a, b = (torch.randn(t, hv, generator=g).to(DEV) for _ in range(2))
    w = torch.randn(c, kk, generator=g).to(DEV)
    alog, dtb = torch.rand(hv, generator=g).to(DEV), torch.rand(hv, generator=g).to(DEV)
    o = gdn_layer(view, pages, init, _cu(), mixed, a, b, w, alog, dtb, num_k_heads=hk,
                  num_v_heads=hv, head_k_dim=dk, head_v_dim=dv)
    y, conv_new = causal_conv1d_naive(mixed, w, None, s0["conv"], _cu(), "silu")
    q, k, v = y.split([hk * dk, hk * dk, hv * dv], -1)
    q = q.reshape(t, hk, dk).repeat_interleave(hv // hk, 1)
    k = k.reshape(t, hk, dk).repeat_interleave(hv // hk, 1)
    gl = -alog.exp() * torch.nn.functional.softplus(a + dtb)
    o0, ssm_new = gdn_naive(q, k, v.reshape(t, hv, dv), gl, b.sigmoid(), s0["ssm"], _cu())
    torch.testing.assert_close(o, o0, **TOL)
    after = view.gather(pages)
    torch.testing.assert_close(after["conv"], conv_new, **TOL)
    torch.testing.assert_close(after["ssm"], ssm_new, **TOL)
    assert calls["gdn"] == 1

    # Mamba-2: 4 heads in 2 groups.
    h, p, gr, nst = 4, 3, 2, 5
    c = h * p + 2 * gr * nst
    view = _view([StateComponent("conv", (c, kk - 1), torch.float32),
                  StateComponent("ssm", (h, p, nst), torch.float32)], 3, 17)
    s0 = fill(view)
    xbc = torch.randn(t, c, generator=g).to(DEV)
    w, cb = torch.randn(c, kk, generator=g).to(DEV), torch.randn(c, generator=g).to(DEV)
    dt = torch.rand(t, h, generator=g).to(DEV)
    A, D = -torch.rand(h, generator=g).to(DEV), torch.randn(h, generator=g).to(DEV)
    y = mamba_scan_layer(view, pages, init, _cu(), xbc, w, cb, dt, A, D, num_heads=h,
                         head_dim=p, n_groups=gr, state_size=nst, y_dtype=torch.float32)
    yc, conv_new = causal_conv1d_naive(xbc, w, cb, s0["conv"], _cu(), "silu")
    xs, B, C = yc.split([h * p, gr * nst, gr * nst], -1)
    y0, ssm_new = ssd_naive(xs.reshape(t, h, p), dt, A, B.reshape(t, gr, nst),
                            C.reshape(t, gr, nst), D, s0["ssm"], _cu(), dt_bias=None,
                            dt_softplus=False)
    torch.testing.assert_close(y, y0, **TOL)
    after = view.gather(pages)
    torch.testing.assert_close(after["conv"], conv_new, **TOL)
    torch.testing.assert_close(after["ssm"], ssm_new, **TOL)
    assert calls["ssd"] == 1
    # A decode batch (one token each) keeps the token loop.
    one = _cu([0, 1, 2])
    mamba_scan_layer(view, pages[:2], init[:2], one, xbc[:2], w, cb, dt[:2], A, D, num_heads=h,
                     head_dim=p, n_groups=gr, state_size=nst, y_dtype=torch.float32)
    assert calls["ssd"] == 1


def test_prefill_chunk_size_and_layout():
    assert prefill_chunk_size(7, 1) == 16 and prefill_chunk_size(40, 3) == 64
    assert prefill_chunk_size(500, 2) == 64 and prefill_chunk_size(33, 2) == 32
    offs, m = chunk_layout(_cu(), 16, torch.tensor([5, 0, 3, 30, 16], device=DEV))
    # 37 tokens from 5: 11 + 16 + 10 -> 3; 1 -> 1; 0 -> 0; 80 from 30: 2 + 4 * 16 + 14 -> 6;
    # 16 from 16: 1
    assert offs.tolist() == [0, 3, 4, 4, 10] and m == 11


def test_chunked_kernels_benchmark_smoke(tmp_path):
    """``python -m benchmarks.chunked_kernels --quick`` runs (in its own process: the
    interpreter must be chosen before triton is imported) and its chunked rows agree with the
    token loops."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    if DEV.type == "cuda":
        pytest.skip("a CPU smoke run: the device check runs the full benchmark itself")
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(repo))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    res = subprocess.run([sys.executable, "-m", "benchmarks.chunked_kernels", "--quick",
                          "--out", str(tmp_path)], capture_output=True, text=True, env=env,
                         cwd=repo, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "| gdn | chunked |" in res.stdout and "| ssd | chunked |" in res.stdout
    rows = json.loads((tmp_path / "chunked_kernels.json").read_text())["rows"]
    assert [(r["kernel"], r["form"]) for r in rows] == [
        ("gdn", "token loop"), ("gdn", "chunked"), ("ssd", "token loop"), ("ssd", "chunked")]
    assert all(r["max_diff"] < 1e-4 and r["tok_s"] > 0 and r["flops"] > 0 for r in rows)
