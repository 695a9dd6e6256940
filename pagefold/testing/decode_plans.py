"""Test helpers for the fast decode plans (:mod:`pagefold.layers.decode_fast`)."""

from __future__ import annotations

import torch


def check_no_scratch_escape(plan, out) -> None:
    """Raise when a tensor ``plan.forward`` returned (``out``: a tensor or a tuple) shares
    storage with one of the plan's scratch tensors: the next layer or step would overwrite
    it while the caller still reads it. Also raise when the plan kept no scratch at all (the
    check would prove nothing)."""
    if not plan.scratch:
        raise AssertionError("the plan kept no scratch tensors")
    held = {b.untyped_storage().data_ptr() for b in plan.scratch.values()}
    for t in out if isinstance(out, tuple) else (out,):
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in held:
            raise AssertionError("a plan's output is one of its scratch tensors")
