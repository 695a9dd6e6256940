"""The batched LoRA Triton kernels against the torch form (under Triton's interpreter
without CUDA, compiled with it), awkward sizes, base rows untouched."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from pagefold.ops.lora import reference  # noqa: E402
from pagefold.ops.lora import triton as lora_triton  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_lora_equals_torch_form(dtype):
    g = torch.Generator().manual_seed(1)
    rows, k, r, o, slots = 7, 70, 24, 67, 3
    x = torch.randn(rows, k, generator=g).to(dtype).to(DEV)
    a = torch.randn(slots, r, k, generator=g).to(dtype).to(DEV)
    b = torch.randn(slots, r, o, generator=g).to(dtype).to(DEV)
    idx = torch.tensor([2, -1, 0, 0, 1, -1, 2], device=DEV)
    v = lora_triton.shrink(x, a, idx)
    v_ref = reference.shrink(x, a, idx)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(v, v_ref, rtol=tol, atol=tol)
    assert not v[idx < 0].any()
    y0 = torch.randn(rows, o, generator=g).to(dtype).to(DEV)
    y, y_ref = y0.clone(), y0.clone()
    assert lora_triton.expand_(y, v_ref, b, idx)
    reference.expand_(y_ref, v_ref, b, idx)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=tol, atol=tol * 10)
    assert torch.equal(y[idx < 0], y0[idx < 0]) and not torch.equal(y[idx >= 0], y0[idx >= 0])
