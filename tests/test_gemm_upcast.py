"""bf16 products through float32 weight slices (``pagefold/csrc/gemm.py``): same values as a
float32 product rounded once, every slice and the bias in the right columns, and the plain
path kept where the upcast does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagefold.csrc import cpu_ops, gemm


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), w.float(), None if b is None else b.float()).bfloat16()


def _assert_rounding_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to one bf16 rounding step (summation order may differ from the reference)."""
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    ulp = want.float().abs().clamp(min=1e-3) * 2.0**-7
    assert bool(((got.float() - want.float()).abs() <= ulp).all())


@pytest.fixture
def upcast_on(monkeypatch):
    monkeypatch.setenv("PAGEFOLD_BF16_UPCAST", "force")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("slice_elems", [1 << 20, 7 * 24, 24])  # one slice; ragged; one row each
def test_matches_float32_product(upcast_on, monkeypatch, bias, slice_elems):
    monkeypatch.setattr(gemm, "SLICE_ELEMS", slice_elems)
    g = torch.Generator().manual_seed(0)
    n, k, m = 45, 24, gemm.MIN_ROWS + 3
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    got = gemm.linear(x, w, b)
    assert got is not None
    _assert_rounding_close(got, _reference(x, w, b))


def test_scratch_made_in_inference_mode_is_writable_outside(upcast_on):
    import threading

    def first_use() -> None:  # a fresh thread: a fresh scratch buffer, made in inference mode
        x = torch.randn(gemm.MIN_ROWS, 8).bfloat16()
        with torch.inference_mode():
            gemm.linear(x, torch.randn(4, 8).bfloat16())
        _assert_rounding_close(gemm.linear(x, torch.randn(2, 8).bfloat16() * 0 + 1),
                               _reference(x, torch.ones(2, 8).bfloat16(), None))

    errors = []
    t = threading.Thread(target=lambda: _catch(first_use, errors))
    t.start()
    t.join()
    assert not errors, errors


def _catch(fn, errors: list) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported by the test thread
        errors.append(e)


def test_strided_input_and_scratch_reuse(upcast_on):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(gemm.MIN_ROWS, 64, generator=g).bfloat16()[:, ::2]  # strided columns
    for n in (40, 8, 40):  # a smaller weight must not read the larger one's leftovers
        w = torch.randn(n, 32, generator=g).bfloat16()
        _assert_rounding_close(gemm.linear(x, w), _reference(x, w, None))


def test_plain_path_where_upcast_does_not_apply(upcast_on, monkeypatch):
    w = torch.randn(8, 16).bfloat16()
    assert gemm.linear(torch.randn(gemm.MIN_ROWS - 1, 16).bfloat16(), w) is None  # few rows
    assert gemm.linear(torch.randn(gemm.MIN_ROWS, 16), w.float()) is None  # float32
    assert gemm.linear(torch.randn(2, gemm.MIN_ROWS, 16).bfloat16(), w) is None  # 3-D
    monkeypatch.setenv("PAGEFOLD_BF16_UPCAST", "0")
    assert gemm.linear(torch.randn(gemm.MIN_ROWS, 16).bfloat16(), w) is None
    monkeypatch.delenv("PAGEFOLD_BF16_UPCAST")  # by default: on only without native bf16
    monkeypatch.setattr(gemm, "cpu_has_fast_bf16", lambda: True)
    assert gemm.linear(torch.randn(gemm.MIN_ROWS, 16).bfloat16(), w) is None
    monkeypatch.setattr(gemm, "cpu_has_fast_bf16", lambda: False)
    assert gemm.linear(torch.randn(gemm.MIN_ROWS, 16).bfloat16(), w) is not None
    x3 = torch.randn(2, 3, 16).bfloat16()
    assert torch.equal(gemm.matmul_t(x3, w), F.linear(x3, w))


def test_float_out_is_the_float32_product_unrounded(upcast_on):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(gemm.MIN_ROWS + 2, 40, generator=g).bfloat16()
    w = torch.randn(70, 40, generator=g).bfloat16()
    ref = x.double() @ w.double().t()
    for slice_elems in (1 << 20, 9 * 40):  # one slice, several
        gemm.SLICE_ELEMS, saved = slice_elems, gemm.SLICE_ELEMS
        try:
            got = gemm.linear(x, w, out_float=True)
        finally:
            gemm.SLICE_ELEMS = saved
        assert got.dtype == torch.float32
        assert (got.double() - ref).abs().max().item() < 1e-4


def test_routed_linear_uses_the_upcast(upcast_on):
    lin = torch.nn.Linear(24, 40, dtype=torch.bfloat16)
    cpu_ops.use_fast_linears(lin)
    assert lin.pf_packed_weight is None  # no bf16 copy kept where products go through float32
    x = torch.randn(gemm.MIN_ROWS + 1, 24).bfloat16()
    with torch.no_grad():
        _assert_rounding_close(lin(x), _reference(x, lin.weight, lin.bias))
