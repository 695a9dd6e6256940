"""Tests for pagefold.ops.gdn.reference: chunked and recurrent kernels against the
naive definition, state hand-off across arbitrary splits, and transformers' reference kernels."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from pagefold.ops.gdn.reference import (
    GDN_KERNELS,
    gdn_chunked,
    gdn_naive,
    gdn_recurrent,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

K_HEADS, V_HEADS, DK, DV = 2, 4, 16, 24
TOL = {"atol": 1e-5, "rtol": 1e-5}
FAST = {"chunked": gdn_chunked, "recurrent": gdn_recurrent}


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.long).cumsum(0)


def _inputs(total: int, num_seqs: int, seed: int, state_scale: float = 1.0):
    """Random GQA-style inputs shaped like a Qwen3.5 GatedDeltaNet layer produces them."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(total, K_HEADS, DK, generator=gen)
    k = torch.randn(total, K_HEADS, DK, generator=gen)
    v = torch.randn(total, V_HEADS, DV, generator=gen)
    rep = V_HEADS // K_HEADS
    q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    a = torch.randn(total, V_HEADS, generator=gen)
    a_log = torch.empty(V_HEADS).uniform_(0.01, 4, generator=gen).log()
    g = -a_log.exp() * F.softplus(a + 1.0)
    beta = torch.rand(total, V_HEADS, generator=gen)
    state = state_scale * torch.randn(num_seqs, V_HEADS, DK, DV, generator=gen)
    return q, k, v, g, beta, state


def _assert_same(got: tuple, ref: tuple, **tol: float) -> None:
    tol = tol or TOL
    torch.testing.assert_close(got[0], ref[0], **tol)
    torch.testing.assert_close(got[1], ref[1], **tol)


@pytest.mark.parametrize("name", ["chunked", "recurrent"])
@pytest.mark.parametrize("chunk_size", [64, 16])
def test_varlen_matches_naive(name: str, chunk_size: int) -> None:
    lengths = [1, 7, 33, 64, 65, 130]
    q, k, v, g, beta, state = _inputs(sum(lengths), len(lengths), seed=chunk_size)
    cu = _cu(lengths)
    ref = gdn_naive(q, k, v, g, beta, state, cu)
    got = FAST[name](q, k, v, g, beta, state, cu, chunk_size=chunk_size)
    assert got[0].shape == v.shape and got[1].shape == state.shape
    assert got[1].dtype == torch.float32
    _assert_same(got, ref)


@pytest.mark.parametrize("name", ["chunked", "recurrent"])
def test_zero_length_and_unsorted_sequences(name: str) -> None:
    lengths = [5, 0, 70, 1, 0, 12]
    q, k, v, g, beta, state = _inputs(sum(lengths), len(lengths), seed=3)
    cu = _cu(lengths)
    got = FAST[name](q, k, v, g, beta, state, cu, chunk_size=32)
    _assert_same(got, gdn_naive(q, k, v, g, beta, state, cu))
    torch.testing.assert_close(got[1][1], state[1], atol=0, rtol=0)
    torch.testing.assert_close(got[1][4], state[4], atol=0, rtol=0)


def test_decode_batch_matches_naive() -> None:
    q, k, v, g, beta, state = _inputs(9, 9, seed=4)
    cu = _cu([1] * 9)
    ref = gdn_naive(q, k, v, g, beta, state, cu)
    for fn in GDN_KERNELS.values():
        _assert_same(fn(q, k, v, g, beta, state, cu), ref)


@pytest.mark.parametrize("name", ["naive", "chunked", "recurrent"])
def test_split_sequence_equals_one_pass(name: str) -> None:
    fn = GDN_KERNELS[name]
    total = 150
    q, k, v, g, beta, state = _inputs(total, 1, seed=5)
    full = fn(q, k, v, g, beta, state, _cu([total]), chunk_size=32)
    pieces = [7, 33, 1, total - 41]
    outs, s, start = [], state, 0
    for n in pieces:
        sl = slice(start, start + n)
        o, s = fn(q[sl], k[sl], v[sl], g[sl], beta[sl], s, _cu([n]), chunk_size=32)
        outs.append(o)
        start += n
    _assert_same((torch.cat(outs), s), full)


def test_split_inside_mixed_batches() -> None:
    # Two sequences advanced in two engine steps with different split points per sequence,
    # batched together with a third, independent decode sequence.
    la, lb = 50, 23
    qa, ka, va, ga, ba, sa = _inputs(la, 1, seed=6)
    qb, kb, vb, gb, bb, sb = _inputs(lb, 1, seed=7)
    qc, kc, vc, gc, bc, sc = _inputs(2, 1, seed=8)
    ref_a = gdn_naive(qa, ka, va, ga, ba, sa, _cu([la]))
    ref_b = gdn_naive(qb, kb, vb, gb, bb, sb, _cu([lb]))
    ref_c = gdn_naive(qc, kc, vc, gc, bc, sc, _cu([2]))
    splits = {"a": 17, "b": 1, "c": 1}
    seqs = {"a": (qa, ka, va, ga, ba), "b": (qb, kb, vb, gb, bb), "c": (qc, kc, vc, gc, bc)}
    for fn in (gdn_chunked, gdn_recurrent):
        states = torch.cat([sa, sb, sc])
        outs = {key: [] for key in seqs}
        for step in range(2):
            parts, lengths = [], []
            for key, tensors in seqs.items():
                cut = splits[key]
                sl = slice(0, cut) if step == 0 else slice(cut, None)
                parts.append([t[sl] for t in tensors])
                lengths.append(parts[-1][0].shape[0])
            cat = [torch.cat(ts) for ts in zip(*parts)]
            o, states = fn(*cat, states, _cu(lengths), chunk_size=16)
            for key, chunk in zip(seqs, o.split(lengths)):
                outs[key].append(chunk)
        for key, ref, i in (("a", ref_a, 0), ("b", ref_b, 1), ("c", ref_c, 2)):
            _assert_same((torch.cat(outs[key]), states[i : i + 1]), ref)


def _hf_layout(x: torch.Tensor, batch: int) -> torch.Tensor:
    # (B*T, ...) flat layout of equal-length sequences -> HF's (B, T, ...).
    return x.reshape(batch, -1, *x.shape[1:])


@pytest.mark.parametrize("seq_len", [70, 5])
def test_matches_hf_chunk_rule(seq_len: int) -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    batch = 2
    q, k, v, g, beta, state = _inputs(batch * seq_len, batch, seed=9)
    rep = V_HEADS // K_HEADS
    # HF repeats grouped heads itself, so hand it the un-repeated q/k heads.
    hf_q, hf_k = (_hf_layout(x[:, ::rep], batch) for x in (q, k))
    hf_o, hf_s = torch_chunk_gated_delta_rule(
        hf_q,
        hf_k,
        _hf_layout(v, batch),
        g=_hf_layout(g, batch),
        beta=_hf_layout(beta, batch),
        chunk_size=64,
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    cu = _cu([seq_len] * batch)
    for fn in GDN_KERNELS.values():
        o, s = fn(q, k, v, g, beta, state, cu)
        _assert_same((o, s), (hf_o.reshape(-1, V_HEADS, DV), hf_s))


@pytest.mark.parametrize("seq_len", [1, 6])
def test_matches_hf_recurrent_rule(seq_len: int) -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    batch = 3
    q, k, v, g, beta, state = _inputs(batch * seq_len, batch, seed=10)
    hf_o, hf_s = torch_recurrent_gated_delta_rule(
        *(_hf_layout(x, batch) for x in (q, k, v)),
        g=_hf_layout(g, batch),
        beta=_hf_layout(beta, batch),
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    cu = _cu([seq_len] * batch)
    for fn in GDN_KERNELS.values():
        o, s = fn(q, k, v, g, beta, state, cu)
        _assert_same((o, s), (hf_o.reshape(-1, V_HEADS, DV), hf_s))


def test_without_l2norm_and_custom_scale() -> None:
    lengths = [9, 40]
    q, k, v, g, beta, state = _inputs(sum(lengths), 2, seed=11)
    # Pre-normalized keys keep the un-normalized recurrence stable.
    k = F.normalize(k, dim=-1)
    cu = _cu(lengths)
    kwargs = {"use_qk_l2norm": False, "scale": 0.3, "chunk_size": 16}
    ref = gdn_naive(q, k, v, g, beta, state, cu, **kwargs)
    for fn in FAST.values():
        _assert_same(fn(q, k, v, g, beta, state, cu, **kwargs), ref)
    # The options must actually change the result.
    default = gdn_naive(q, k, v, g, beta, state, cu)
    assert not torch.allclose(default[0], ref[0], atol=1e-3)


@pytest.mark.parametrize("name", ["naive", "chunked", "recurrent"])
def test_low_precision_inputs(name: str) -> None:
    lengths = [3, 20]
    q, k, v, g, beta, state = _inputs(sum(lengths), 2, seed=12)
    cu = _cu(lengths)
    qb, kb, vb, bb = (x.bfloat16() for x in (q, k, v, beta))
    state_copy = state.clone()
    o, s = GDN_KERNELS[name](qb, kb, vb, g, bb, state, cu)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    torch.testing.assert_close(state, state_copy, atol=0, rtol=0)  # not modified in place
    ref = gdn_naive(qb.float(), kb.float(), vb.float(), g, bb.float(), state, cu)
    torch.testing.assert_close(o, ref[0].bfloat16())
    torch.testing.assert_close(s, ref[1], **TOL)


def test_rejects_bad_state_shape() -> None:
    q, k, v, g, beta, state = _inputs(4, 2, seed=13)
    with pytest.raises(ValueError):
        gdn_chunked(q, k, v, g, beta, state[:1], _cu([2, 2]))
