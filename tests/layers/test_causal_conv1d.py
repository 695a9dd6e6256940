"""Tests for pagefold.ops.conv1d.reference: varlen and decode paths against the naive loop and
against transformers' depthwise-conv usage."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from pagefold.ops.conv1d.reference import (
    causal_conv1d_naive,
    causal_conv1d_update,
    causal_conv1d_varlen,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CHANNELS = 12


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.long).cumsum(0)


def _inputs(lengths: list[int], kernel: int, seed: int, bias: bool = True):
    gen = torch.Generator().manual_seed(seed)
    total, num = sum(lengths), len(lengths)
    x = torch.randn(total, CHANNELS, generator=gen)
    weight = torch.randn(CHANNELS, kernel, generator=gen)
    b = torch.randn(CHANNELS, generator=gen) if bias else None
    state = torch.randn(num, CHANNELS, kernel - 1, generator=gen)
    return x, weight, b, state, _cu(lengths)


@pytest.mark.parametrize("kernel", [2, 3, 4, 5])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("compiled", [True, False])
def test_varlen_matches_naive(kernel: int, activation: str | None, compiled: bool) -> None:
    lengths = [1, 2, 7, 0, 33, 3, 64]
    x, w, b, state, cu = _inputs(lengths, kernel, seed=kernel)
    y_ref, s_ref = causal_conv1d_naive(x, w, b, state, cu, activation=activation)
    y, s = causal_conv1d_varlen(x, w, b, state, cu, activation=activation, compiled=compiled)
    assert y.shape == x.shape and s.shape == state.shape
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
    # The zero-length sequence keeps its state untouched.
    torch.testing.assert_close(s[3], state[3], atol=0, rtol=0)


def test_varlen_without_bias() -> None:
    x, w, _, state, cu = _inputs([5, 1, 9], kernel=4, seed=1, bias=False)
    y_ref, s_ref = causal_conv1d_naive(x, w, None, state, cu)
    y, s = causal_conv1d_varlen(x, w, None, state, cu)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_ref)


@pytest.mark.parametrize("kernel", [2, 3, 4, 5])
def test_update_matches_naive(kernel: int) -> None:
    x, w, b, state, cu = _inputs([1] * 6, kernel, seed=10 + kernel)
    y_ref, s_ref = causal_conv1d_naive(x, w, b, state, cu)
    y, s = causal_conv1d_update(x, w, b, state)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
    y2, s2 = causal_conv1d_varlen(x, w, b, state, cu)
    torch.testing.assert_close(y2, y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s2, s)


@pytest.mark.parametrize("kernel", [3, 4, 5])
def test_state_with_fewer_than_k_minus_1_tokens(kernel: int) -> None:
    # Sequences of 1 .. K-2 new tokens: the new state mixes old state and new inputs.
    lengths = list(range(1, kernel - 1))
    x, w, b, state, cu = _inputs(lengths, kernel, seed=20 + kernel)
    for fn in (causal_conv1d_naive, causal_conv1d_varlen):
        _, s = fn(x, w, b, state, cu)
        for i in range(len(lengths)):
            new = x[cu[i] : cu[i + 1]].t()
            expected = torch.cat([state[i], new], dim=1)[:, -(kernel - 1) :]
            torch.testing.assert_close(s[i], expected, atol=0, rtol=0)


@pytest.mark.parametrize("kernel", [2, 4])
def test_split_equals_one_pass(kernel: int) -> None:
    x, w, b, state, _ = _inputs([60], kernel, seed=30 + kernel)
    y_full, s_full = causal_conv1d_varlen(x, w, b, state, _cu([60]))
    pieces, outs, s = [7, 1, 33, 2, 17], [], state
    start = 0
    for n in pieces:
        y, s = causal_conv1d_varlen(x[start : start + n], w, b, s, _cu([n]))
        outs.append(y)
        start += n
    torch.testing.assert_close(torch.cat(outs), y_full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_full)


@pytest.mark.parametrize("kernel", [2, 4, 5])
def test_fresh_sequence_matches_hf_conv(kernel: int) -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    lengths = [9, 3, 20]
    x, w, b, _, cu = _inputs(lengths, kernel, seed=40 + kernel)
    zeros = torch.zeros(len(lengths), CHANNELS, kernel - 1)
    y, s = causal_conv1d_varlen(x, w, b, zeros, cu)
    for i, n in enumerate(lengths):
        seq = x[cu[i] : cu[i + 1]].t().unsqueeze(0)  # (1, C, L), HF layout
        # The way nn.Conv1d(padding=K-1, groups=C) is applied in HF, then sliced to L.
        ref = F.silu(F.conv1d(seq, w.unsqueeze(1), b, padding=kernel - 1, groups=CHANNELS)[..., :n])
        torch.testing.assert_close(y[cu[i] : cu[i + 1]], ref[0].t(), atol=1e-5, rtol=1e-5)
        hf = causal_conv1d_fn(seq, w, b, activation="silu")
        torch.testing.assert_close(y[cu[i] : cu[i + 1]], hf[0].t(), atol=1e-5, rtol=1e-5)
        # HF caches the last inputs, left-padded with zeros for short prompts.
        expected_state = F.pad(seq[0], (kernel - 1, 0))[:, -(kernel - 1) :]
        torch.testing.assert_close(s[i], expected_state)


def test_update_matches_hf_update() -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_update as hf_update

    x, w, b, state, _ = _inputs([1] * 4, kernel=4, seed=50)
    y, s = causal_conv1d_update(x, w, b, state)
    hf_state = state.clone()
    hf_y = hf_update(x.unsqueeze(2), hf_state, w, b, activation="silu")  # updates hf_state
    torch.testing.assert_close(y, hf_y[:, :, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, hf_state)


def test_dtype_preserved_and_inputs_untouched() -> None:
    x, w, b, state, cu = _inputs([3, 5], kernel=4, seed=60)
    xb, sb = x.bfloat16(), state.bfloat16()
    sb_copy = sb.clone()
    y, s = causal_conv1d_varlen(xb, w, b, sb, cu)
    assert y.dtype == torch.bfloat16 and s.dtype == torch.bfloat16
    torch.testing.assert_close(sb, sb_copy, atol=0, rtol=0)
    y_ref, _ = causal_conv1d_naive(xb, w, b, sb, cu)
    torch.testing.assert_close(y, y_ref)
    yu, su = causal_conv1d_update(xb[:2], w, b, sb)
    assert yu.dtype == torch.bfloat16 and su.dtype == torch.bfloat16


def test_rejects_bad_shapes() -> None:
    x, w, b, state, cu = _inputs([3], kernel=4, seed=70)
    with pytest.raises(ValueError):
        causal_conv1d_varlen(x, w, b, state[:, :, :2], cu)
    with pytest.raises(ValueError):
        causal_conv1d_varlen(x, w, b, state, cu, activation="gelu")


@pytest.fixture
def conv_calls(monkeypatch):
    """Counts the compiled conv calls that returned a result."""
    from pagefold.ops.conv1d import cpu as mod

    n = [0]
    real = mod.conv_varlen_cpu

    def counting(*a, **k):
        res = real(*a, **k)
        n[0] += res is not None
        return res

    monkeypatch.setattr(mod, "conv_varlen_cpu", counting)
    return n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_compiled_varlen_matches_naive(conv_calls, dtype, bias) -> None:
    """The compiled conv (csrc/conv.cpp) ran, over two channel blocks (300 channels), with x
    a column slice of wider rows (as the Mamba-2 mixer passes it), in both dtypes."""
    from pagefold.csrc import cpu_ops

    if cpu_ops.kernels() is None:
        pytest.skip("no C++ compiler")
    gen = torch.Generator().manual_seed(7)
    lengths, c, k = [1, 2, 0, 40, 3], 300, 4
    wide = torch.randn(sum(lengths), c + 20, generator=gen).to(dtype)
    x = wide[:, 10 : 10 + c]
    w = torch.randn(c, k, generator=gen).to(dtype)
    b = torch.randn(c, generator=gen).to(dtype) if bias else None
    state = torch.randn(len(lengths), c, k - 1, generator=gen).to(dtype)
    y, s = causal_conv1d_varlen(x, w, b, state, _cu(lengths))
    assert conv_calls[0] == 1 and y.dtype == dtype and s.dtype == dtype
    y_ref, s_ref = causal_conv1d_naive(x, w, b, state, _cu(lengths))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y, y_ref, atol=tol, rtol=tol)
    assert torch.equal(s, s_ref)
    y_t, s_t = causal_conv1d_varlen(x, w, b, state, _cu(lengths), compiled=False)
    assert conv_calls[0] == 1 and torch.equal(s_t, s)
    cpu_ops.set_enabled(False)
    try:
        y_off, _ = causal_conv1d_varlen(x, w, b, state, _cu(lengths))
    finally:
        cpu_ops.set_enabled(True)
    assert conv_calls[0] == 1 and torch.equal(y_off, y_t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [True, False])
def test_varlen_captures_into_pages(conv_calls, dtype, compiled) -> None:
    """``capture=(after, PagedOut)``: each capture's window (``causal_conv1d_state_at``'s,
    the old state in front for tokens near a sequence's start) lands in its checkpoint's
    pages over two channel blocks and a page boundary, bit for bit, and nothing else moves;
    the compiled conv writes them itself, the torch form through ``PagedOut.write``; ``y``
    and the final states are those of the call without captures; a buffer ``out`` works."""
    from pagefold.core.kv_cache_spec import StateComponent, StateSpec
    from pagefold.csrc import cpu_ops
    from pagefold.executor.cache_tensors import StateView
    from pagefold.ops.conv1d.reference import causal_conv1d_state_at

    if cpu_ops.kernels() is None:
        pytest.skip("no C++ compiler")
    gen = torch.Generator().manual_seed(9)
    lengths, c, k = [1, 2, 0, 40, 3], 300, 4
    cu = _cu(lengths)
    x = torch.randn(sum(lengths), c + 20, generator=gen).to(dtype)[:, 10 : 10 + c]
    w = torch.randn(c, k, generator=gen).to(dtype)
    b = torch.randn(c, generator=gen).to(dtype)
    state = torch.randn(len(lengths), c, k - 1, generator=gen).to(dtype)
    after = torch.tensor([0, 2, 1, 3, 4, 20, 42, 45, 44, 20])  # starts, inside, ends, repeat
    spec = StateSpec(kind="mamba2", components=(
        StateComponent("ssm", (2, 4, 4), torch.float32), StateComponent("conv", (c, k - 1), dtype)))
    pb = 1000  # a state spans pages; windows cross page boundaries
    pps = -(-spec.state_bytes // pb)
    raw = torch.randint(0, 255, (len(after) * pps + 3, pb), dtype=torch.uint8, generator=gen)
    ids = torch.randperm(raw.shape[0], generator=gen)[: len(after) * pps].view(len(after), pps)
    view = StateView(raw, spec, pps)
    before = raw.clone()
    y0, s0 = causal_conv1d_varlen(x, w, b, state, cu, compiled=compiled)
    calls0 = conv_calls[0]
    y, s = causal_conv1d_varlen(x, w, b, state, cu, compiled=compiled,
                                capture=(after, view.paged(ids, "conv")))
    assert conv_calls[0] == calls0 + (1 if compiled else 0)
    assert torch.equal(y, y0) and torch.equal(s, s0)
    want = causal_conv1d_state_at(x, state, cu, after)
    assert torch.equal(view.gather(ids)["conv"], want)
    mask = torch.zeros(raw.shape, dtype=torch.bool)
    off, nbytes = view.offset("conv"), spec.component("conv").nbytes
    for row in ids.tolist():
        flat = torch.zeros(len(row) * pb, dtype=torch.bool)
        flat[off : off + nbytes] = True
        mask[row] = flat.view(len(row), pb)
    assert torch.equal(raw[~mask], before[~mask])
    buf = torch.empty(len(after), c, k - 1, dtype=dtype)
    causal_conv1d_varlen(x, w, b, state, cu, compiled=compiled, capture=(after, buf))
    assert torch.equal(buf, want) and conv_calls[0] == calls0 + (2 if compiled else 0)
