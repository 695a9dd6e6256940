"""oneDNN products with their rows padded to a few sizes (``csrc/gemm.py``: ``bucket_rows``,
``onednn_linear``): the sizes, and the same bits as the unpadded ``F.linear`` for every row
count, packed or not, with and without a bias, through a routed ``nn.Linear`` and through the
MoE experts' ``matmul_t``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagefold.csrc import cpu_ops, gemm


def test_bucket_rows_sizes():
    seen = set()
    for m in range(1, 8193):
        b = gemm.bucket_rows(m)
        assert b >= m and b * 8 <= m * 9  # at most an eighth more rows
        if m <= 32:
            assert b == m
        assert gemm.bucket_rows(b) == b  # a bucket is its own size
        seen.add(b)
    # 32 exact sizes, then 8 per power of two from 32 up to 8192.
    assert len(seen) == 32 + 8 * 8
    assert [gemm.bucket_rows(m) for m in (33, 36, 37, 64, 65, 73, 300, 513, 1000)] == \
        [36, 36, 40, 64, 72, 80, 320, 576, 1024]


def _inputs(m: int, n: int = 37, k: int = 100, bias: bool = True):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k + 3, generator=g).bfloat16()[:, 1 : k + 1]  # rows k + 3 apart
    w = (torch.randn(n, k, generator=g) * k**-0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    return x, w, b


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_padded_product_is_the_unpadded_one(bias, packed):
    for m in (0, 1, 17, 32, 33, 35, 47, 100, 129, 257, 515):
        x, w, b = _inputs(m, bias=bias)
        p = cpu_ops.prepack(w) if packed else None
        if packed and p is None:
            pytest.skip("no oneDNN packed layout on this build")
        got = gemm.onednn_linear(x, w, b, p)
        want = F.linear(x, w, b)
        assert got.shape == (m, w.shape[0])
        assert torch.equal(got, want), m
        if gemm.bucket_rows(m) != m:  # ran padded: a view of the first rows
            assert got._base is not None and got._base.shape[0] == gemm.bucket_rows(m)


def test_float32_rows_are_not_padded():
    x, w, b = _inputs(45)
    got = gemm.onednn_linear(x.float(), w.float(), b.float())
    assert got._base is None and torch.equal(got, F.linear(x.float(), w.float(), b.float()))


def test_routed_linear_and_expert_products_keep_their_bits(monkeypatch):
    """A routed ``nn.Linear`` above its GEMV's rows and ``matmul_t`` (experts) at row counts
    that are not buckets: ``F.linear``'s bits."""
    monkeypatch.setenv("PAGEFOLD_BF16_UPCAST", "0")  # the oneDNN path on any CPU
    lin = torch.nn.Linear(100, 37, dtype=torch.bfloat16)
    cpu_ops.use_fast_linears(lin)
    for m in (40, 77, 300):
        x, _, _ = _inputs(m)
        with torch.no_grad():
            assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
            assert torch.equal(gemm.matmul_t(x, lin.weight), F.linear(x, lin.weight))


def test_inputs_of_other_ranks_are_not_padded():
    """A 3-D input (batch, tokens, features) goes to ``F.linear`` as it is, whatever its
    first size."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(37, 20, generator=g).bfloat16()
    for shape in ((33, 5, 20), (3, 40, 20), (1, 7, 20)):
        x = torch.randn(*shape, generator=g).bfloat16()
        got = gemm.onednn_linear(x, w)
        assert got.shape == (*shape[:2], 37) and torch.equal(got, F.linear(x, w))
