"""Every Triton kernel against its naive / torch version at awkward shapes.

Without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set here
before the kernels are imported); with CUDA (the device check) the same tests run compiled.
Shapes are tiny: the interpreter executes every program in Python.
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
from pagefold.ops import attention as backend  # noqa: E402
from pagefold.ops.attention import triton as tattn  # noqa: E402
from pagefold.ops.conv1d.reference import causal_conv1d_naive  # noqa: E402
from pagefold.ops.conv1d.triton import causal_conv1d_triton  # noqa: E402
from pagefold.ops.elementwise import triton as tew  # noqa: E402
from pagefold.ops.gdn.reference import gdn_naive  # noqa: E402
from pagefold.ops.gdn.triton import gdn_layer, gdn_triton  # noqa: E402
from pagefold.ops.ssd.reference import ssd_naive  # noqa: E402
from pagefold.ops.ssd.triton import mamba_scan_layer, ssd_triton  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CU = [0, 5, 6, 6, 13]  # lengths 5, 1, 0, 7: a decode-like row and an empty one


def _cu(lst=CU):
    return torch.tensor(lst, dtype=torch.int64, device=DEV)


def _close(a, b, dtype):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("k,bias", [(4, True), (2, False)])
def test_conv_matches_naive(k, bias):
    g = torch.Generator().manual_seed(k)
    c, n = 13, len(CU) - 1
    x = torch.randn(CU[-1], c, generator=g).to(DEV)
    w = torch.randn(c, k, generator=g).to(DEV)
    b = torch.randn(c, generator=g).to(DEV) if bias else None
    st = torch.randn(n, c, k - 1, generator=g).to(DEV)
    y, s = causal_conv1d_triton(x, w, b, st, _cu(), "silu")
    y0, s0 = causal_conv1d_naive(x, w, b, st, _cu(), "silu")
    _close(y, y0, torch.float32)
    _close(s, s0, torch.float32)


@pytest.mark.parametrize("l2", [True, False])
def test_gdn_matches_naive_with_intermediate_states(l2):
    g = torch.Generator().manual_seed(1)
    t, h, dk, dv, n = CU[-1], 3, 12, 7, len(CU) - 1
    q, k = (torch.randn(t, h, dk, generator=g).to(DEV) for _ in range(2))
    v = torch.randn(t, h, dv, generator=g).to(DEV)
    gl = -torch.rand(t, h, generator=g).to(DEV)
    beta = torch.rand(t, h, generator=g).to(DEV)
    s0 = torch.randn(n, h, dk, dv, generator=g).to(DEV)
    inter = torch.zeros(t, h, dk, dv, device=DEV)
    o, s = gdn_triton(q, k, v, gl, beta, s0, _cu(), use_qk_l2norm=l2, intermediate=inter)
    o0, f0 = gdn_naive(q, k, v, gl, beta, s0, _cu(), use_qk_l2norm=l2)
    _close(o, o0, torch.float32)
    _close(s, f0, torch.float32)
    # The state after token 2 of sequence 0 and after the last token of sequence 3.
    _, f2 = gdn_naive(q[:3], k[:3], v[:3], gl[:3], beta[:3], s0[:1], _cu([0, 3]),
                      use_qk_l2norm=l2)
    _close(inter[2], f2[0], torch.float32)
    _close(inter[12], f0[3], torch.float32)


def test_ssd_matches_naive():
    g = torch.Generator().manual_seed(2)
    t, h, p, gr, nst, n = CU[-1], 6, 5, 2, 12, len(CU) - 1
    x = torch.randn(t, h, p, generator=g).to(DEV)
    dt = torch.randn(t, h, generator=g).to(DEV)
    A = -torch.rand(h, generator=g).to(DEV) - 0.1
    B, C = (torch.randn(t, gr, nst, generator=g).to(DEV) for _ in range(2))
    D = torch.randn(h, generator=g).to(DEV)
    bias = torch.randn(h, generator=g).to(DEV)
    s0 = torch.randn(n, h, p, nst, generator=g).to(DEV)
    inter = torch.zeros(t, h, p, nst, device=DEV)
    kw = dict(dt_bias=bias, dt_min=0.05, dt_max=2.0)
    y, s = ssd_triton(x, dt, A, B, C, D, s0, _cu(), intermediate=inter, **kw)
    y0, f0 = ssd_naive(x, dt, A, B, C, D, s0, _cu(), **kw)
    _close(y, y0, torch.float32)
    _close(s, f0, torch.float32)
    _close(inter[12], f0[3], torch.float32)
    y1, _ = ssd_triton(x, dt, A, B, C, None, s0, _cu(), dt_bias=None)
    y2, _ = ssd_naive(x, dt, A, B, C, None, s0, _cu(), dt_bias=None)
    _close(y1, y2, torch.float32)


def _view(components, pages_per_state, num_blocks=9):
    """A state pool whose states span ``pages_per_state`` non-adjacent pages."""
    spec = StateSpec(kind="test", components=tuple(components))
    page_bytes = -(-spec.state_bytes // pages_per_state)
    page_bytes = -(-page_bytes // 16) * 16
    raw = torch.randint(0, 255, (num_blocks, page_bytes), dtype=torch.uint8, device=DEV)
    return StateView(raw, spec, pages_per_state)


def _pages(n, pps, num_blocks=9):
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(7))[: n * pps]
    return perm.view(n, pps).to(DEV)


def _fresh_mask(n):
    return torch.tensor([True, False, True, True][:n], device=DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_layer_on_pages_matches_torch_path(dtype):
    g = torch.Generator().manual_seed(3)
    hk, hv, dk, dv, kk = 2, 4, 8, 6, 4
    c = 2 * hk * dk + hv * dv
    n, t = len(CU) - 1, CU[-1]
    view = _view([StateComponent("conv", (c, kk - 1), dtype),
                  StateComponent("ssm", (hv, dk, dv), torch.float32)], pages_per_state=2)
    pages, init = _pages(n, 2), _fresh_mask(n)
    st = view.gather(pages)  # random bytes: replaced by finite starting states
    st = {kname: torch.randn(v.shape, generator=g).to(DEV, v.dtype) for kname, v in st.items()}
    view.scatter(pages, st)
    mixed = torch.randn(t, c, generator=g).to(DEV, dtype)
    a, b = (torch.randn(t, hv, generator=g).to(DEV, dtype) for _ in range(2))
    w = torch.randn(c, kk, generator=g).to(DEV, dtype)
    alog, dtb = torch.rand(hv, generator=g).to(DEV), torch.rand(hv, generator=g).to(DEV, dtype)
    o = gdn_layer(view, pages, init, _cu(), mixed, a, b, w, alog, dtb, num_k_heads=hk,
                  num_v_heads=hv, head_k_dim=dk, head_v_dim=dv)
    # Reference: gather, zero the fresh ones, naive conv + rule.
    s0 = {kname: v.clone() for kname, v in st.items()}
    for v in s0.values():
        v[~init] = 0
    y, conv_new = causal_conv1d_naive(mixed, w, None, s0["conv"], _cu(), "silu")
    q, k, v = y.split([hk * dk, hk * dk, hv * dv], -1)
    q = q.reshape(t, hk, dk).repeat_interleave(hv // hk, 1)
    k = k.reshape(t, hk, dk).repeat_interleave(hv // hk, 1)
    gl = -alog.float().exp() * torch.nn.functional.softplus(a.float() + dtb)
    o0, ssm_new = gdn_naive(q, k, v.reshape(t, hv, dv), gl, b.sigmoid(), s0["ssm"], _cu())
    _close(o, o0, dtype)
    after = view.gather(pages)
    _close(after["conv"], conv_new, dtype)
    _close(after["ssm"], ssm_new, torch.float32 if dtype == torch.float32 else dtype)


def test_mamba_layer_on_pages_matches_torch_path():
    g = torch.Generator().manual_seed(4)
    h, p, gr, nst, kk = 4, 3, 2, 5, 4
    c = h * p + 2 * gr * nst
    n, t = len(CU) - 1, CU[-1]
    view = _view([StateComponent("conv", (c, kk - 1), torch.float32),
                  StateComponent("ssm", (h, p, nst), torch.float32)], pages_per_state=3,
                 num_blocks=13)
    pages, init = _pages(n, 3, 13), _fresh_mask(n)
    st = {kname: torch.randn(v.shape, generator=g).to(DEV) for kname, v
          in view.gather(pages).items()}
    view.scatter(pages, st)
    xbc = torch.randn(t, c, generator=g).to(DEV)
    w, cb = torch.randn(c, kk, generator=g).to(DEV), torch.randn(c, generator=g).to(DEV)
    dt = torch.rand(t, h, generator=g).to(DEV)
    A, D = -torch.rand(h, generator=g).to(DEV), torch.randn(h, generator=g).to(DEV)
    y = mamba_scan_layer(view, pages, init, _cu(), xbc, w, cb, dt, A, D, num_heads=h,
                         head_dim=p, n_groups=gr, state_size=nst, y_dtype=torch.float32)
    s0 = {kname: v.clone() for kname, v in st.items()}
    for v in s0.values():
        v[~init] = 0
    yc, conv_new = causal_conv1d_naive(xbc, w, cb, s0["conv"], _cu(), "silu")
    xs, B, C = yc.split([h * p, gr * nst, gr * nst], -1)
    y0, ssm_new = ssd_naive(xs.reshape(t, h, p), dt, A, B.reshape(t, gr, nst),
                            C.reshape(t, gr, nst), D, s0["ssm"], _cu(), dt_bias=None,
                            dt_softplus=False)
    _close(y, y0, torch.float32)
    after = view.gather(pages)
    _close(after["conv"], conv_new, torch.float32)
    _close(after["ssm"], ssm_new, torch.float32)


def _attention_case(dtype, window, bs):
    """A mixed batch: two decode rows, a fresh prompt and a chunk after a 21-token prefix,
    over random non-adjacent blocks; GQA 6 query heads on 2 kv heads, head dim 12."""
    g = torch.Generator().manual_seed(5)
    h, kvh, d, nb = 6, 2, 12, 40
    cache = torch.full((nb, bs, 2, kvh, d), float("nan"), dtype=dtype, device=DEV)
    # rows: (ctx_len, q_len)
    rows = [(9, 1), (0, 7), (37, 1), (21, 5)]
    perm = torch.randperm(nb - 1, generator=g) + 1
    tables, used = [], 0
    for ctx, ql in rows:
        nblk = -(-(ctx + ql) // bs)
        tables.append(perm[used : used + nblk].tolist())
        used += nblk
    # Earlier context already in the cache.
    for (ctx, _), tab in zip(rows, tables):
        for p in range(ctx):
            cache[tab[p // bs], p % bs] = torch.randn(2, kvh, d, generator=g).to(DEV, dtype)
    t = sum(ql for _, ql in rows)
    q = torch.randn(t, h, d, generator=g).to(DEV, dtype)
    k, v = (torch.randn(t, kvh, d, generator=g).to(DEV, dtype) for _ in range(2))
    slots, prefills, dec_tok, dec_tab, dec_len, dec_start, tok = [], [], [], [], [], [], 0
    width = max(len(x) for x in tables)
    for (ctx, ql), tab in zip(rows, tables):
        slots += [tab[p // bs] * bs + p % bs for p in range(ctx, ctx + ql)]
        if ql == 1:
            dec_tok.append(tok)
            dec_tab.append(tab + [0] * (width - len(tab)))
            dec_len.append(ctx + 1)
            dec_start.append(max(ctx + 1 - window, 0) if window else 0)
        else:
            lo = max(0, ctx - window + 1) if window else 0
            kv = [tab[p // bs] * bs + p % bs for p in range(lo, ctx + ql)]
            prefills.append(backend.PrefillRow(tok, tok + ql, ctx, lo,
                                               torch.tensor(kv, device=DEV)))
        tok += ql
    i64 = dict(dtype=torch.int64, device=DEV)
    meta = lambda: backend.AttentionMetadata(  # noqa: E731
        slot_mapping=torch.tensor(slots, **i64), decode_tok=torch.tensor(dec_tok, **i64),
        decode_tables=torch.tensor(dec_tab, **i64), decode_seq_lens=torch.tensor(dec_len, **i64),
        decode_kv_start=torch.tensor(dec_start, **i64) if window else None, block_size=bs,
        prefills=prefills, sliding_window=window)
    return q, k, v, cache, meta


@pytest.mark.parametrize("dtype,window,bs", [(torch.float32, None, 16),
                                             (torch.float32, 6, 5),
                                             (torch.bfloat16, None, 16)])
def test_paged_attention_matches_torch_path(dtype, window, bs, monkeypatch):
    from pagefold.csrc import cpu_ops

    q, k, v, cache, meta = _attention_case(dtype, window, bs)
    c1 = cache.clone()
    out = tattn.paged_attention(q, k, v, c1, meta(), 0.3)
    monkeypatch.setattr(cpu_ops, "kernels", lambda: None)  # the torch path
    c0 = cache.clone()
    ref = backend.paged_attention(q.cpu(), k.cpu(), v.cpu(), c0.cpu(), _cpu(meta()), 0.3)
    _close(out.cpu(), ref, dtype)
    torch.testing.assert_close(c1.cpu(), c0.cpu(), equal_nan=True)  # same K/V writes


def _cpu(m):
    f = {n: getattr(m, n) for n in ("slot_mapping", "decode_tok", "decode_tables",
                                     "decode_seq_lens", "decode_kv_start")}
    f = {n: (x.cpu() if x is not None else None) for n, x in f.items()}
    rows = [backend.PrefillRow(r.tok_start, r.tok_end, r.ctx_len, r.kv_start, r.kv_slots.cpu())
            for r in m.prefills]
    return backend.AttentionMetadata(**f, block_size=m.block_size, prefills=rows,
                                     sliding_window=m.sliding_window)


def test_padding_rows_write_and_read_nothing():
    """Negative slots (padding rows of a captured decode batch) are skipped; a decode row
    with no keys outputs zeros."""
    cache = torch.zeros(3, 4, 2, 1, 8, device=DEV)
    k = torch.ones(2, 1, 8, device=DEV)
    tattn.write_kv(cache, torch.tensor([5, -1], device=DEV), k, k)
    assert cache.view(-1, 2, 1, 8)[5].eq(1).all() and cache.sum() == 16
    q = torch.ones(1, 2, 8, device=DEV)
    out = torch.full_like(q, 7.0)
    tattn.decode_attention(q, None, cache, torch.zeros(1, 1, dtype=torch.int64, device=DEV),
                           torch.zeros(1, dtype=torch.int64, device=DEV), None, 1.0, out)
    assert out.eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_kernels_match_torch(dtype):
    from pagefold.layers.norm import RMSNorm
    from pagefold.layers.rotary import RotaryEmbedding
    from pagefold.models.qwen3_5 import RMSNormGated

    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 13, generator=g).to(DEV, dtype)
    res = torch.randn(5, 13, generator=g).to(DEV, dtype)
    for zc in (False, True):
        norm = RMSNorm(13, 1e-6, zero_centered=zc).to(DEV, dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(13, generator=g))
        _close(tew.rms_norm(x, norm.weight, 1e-6, zc), norm.reference(x), dtype)
        r1 = res.clone()
        out = tew.rms_norm(x, norm.weight, 1e-6, zc, residual=r1)
        s = x + res
        _close(r1, s, dtype)
        _close(out, norm.reference(s), dtype)
    gu = torch.randn(4, 22, generator=g).to(DEV, dtype)
    gate, up = gu.split(11, -1)
    _close(tew.silu_and_mul(gu), torch.nn.functional.silu(gate) * up, dtype)
    gn = RMSNormGated(6).to(DEV, dtype)
    with torch.no_grad():
        gn.weight.copy_(torch.randn(6, generator=g))
    xg, zg = (torch.randn(3, 4, 6, generator=g).to(DEV, dtype) for _ in range(2))
    _close(tew.rms_norm_gated(xg, zg, gn.weight, 1e-6), gn.reference(xg, zg), dtype)

    class Cfg:
        rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}

    h, kvh, d, rot = 3, 1, 12, 8
    rope = RotaryEmbedding(Cfg(), d, 64, rotary_dim=rot).to(DEV)
    qkv = torch.randn(4, (h + 2 * kvh) * d, generator=g).to(DEV, dtype)
    pos = torch.tensor([0, 5, 17, 63], device=DEV)
    qn, kn = RMSNorm(d).to(DEV, dtype), RMSNorm(d).to(DEV, dtype)
    with torch.no_grad():
        qn.weight.copy_(torch.randn(d, generator=g))
        kn.weight.copy_(torch.randn(d, generator=g))
    got = tew.qk_norm_rope(qkv, pos, rope.cos, rope.sin, num_heads=h, num_kv_heads=kvh,
                           head_dim=d, q_off=0, q_head_stride=d, k_off=h * d,
                           q_weight=qn.weight, k_weight=kn.weight, eps=1e-6, zero_centered=False)
    q0 = qn.reference(qkv[:, : h * d].reshape(4, h, d))
    k0 = kn.reference(qkv[:, h * d : (h + kvh) * d].reshape(4, kvh, d))
    q0, k0 = rope(pos, q0, k0)
    _close(got[0], q0, dtype)
    _close(got[1], k0, dtype)
