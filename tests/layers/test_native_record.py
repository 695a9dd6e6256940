"""``native_record.state_layout``: a state view's kernel layout, asked once per (view, shapes)."""

from __future__ import annotations

import pytest
import torch

from pagefold.core.kv_cache_spec import StateComponent, StateSpec
from pagefold.csrc import cpu_ops
from pagefold.executor.cache_tensors import StateView
from pagefold.layers import native_record

needs_kernels = pytest.mark.skipif(cpu_ops.kernels() is None, reason="no compiled kernels")


def _view(conv_dtype=torch.bfloat16, ssm_dtype=torch.float32) -> StateView:
    spec = StateSpec(kind="gdn", components=(
        StateComponent("conv", (24, 3), conv_dtype),
        StateComponent("ssm", (2, 8, 8), ssm_dtype)))
    raw = torch.zeros((4, 1024), dtype=torch.uint8)
    return StateView(raw, spec, -(-spec.state_bytes // 1024))


@needs_kernels
def test_state_layout_is_the_specs_offsets_and_follows_the_callers_shapes():
    """The kept answer is the spec's own offsets and dtype code; asked again with other
    shapes (or for a view whose conv state is not bf16) it is not the kept one."""
    view = _view()
    offs = dict(zip((c.name for c in view.spec.components), view.spec.offsets))
    args = ((24, 3), (2, 8, 8), (torch.float32, torch.bfloat16))
    want = (offs["conv"], offs["ssm"], 0)
    assert native_record.state_layout(view, *args) == want
    assert native_record.state_layout(view, *args) == want  # from the memo
    assert native_record.state_layout(view, (24, 4), (2, 8, 8), args[2]) is None
    assert native_record.state_layout(view, (24, 3), (2, 8, 4), args[2]) is None
    assert native_record.state_layout(view, (24, 3), (2, 8, 8), (torch.bfloat16,)) is None
    assert native_record.state_layout(view, *args) == want
    assert native_record.state_layout(_view(ssm_dtype=torch.bfloat16), *args)[2] == 1
    assert native_record.state_layout(_view(conv_dtype=torch.float32), *args) is None
