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


def count_plan_calls(monkeypatch, plan_cls) -> tuple[list[int], list[int]]:
    """Patch ``plan_cls.forward`` and ``decode_native.NativeBlocks.forward`` to count their
    calls: returns ``(plan calls, native calls)`` (one-element lists, updated as the engine
    runs). Each plan call that did not go through the C driver also checks that no scratch
    tensor escapes (the driver's scratch lives in C, for one call)."""
    from pagefold.layers import decode_native

    calls, native_calls = [0], [0]
    forward, native_forward = plan_cls.forward, decode_native.NativeBlocks.forward

    def counting(self, *args, **kw):
        calls[0] += 1
        before = native_calls[0]
        out = forward(self, *args, **kw)
        if native_calls[0] == before:
            check_no_scratch_escape(self, out)
        return out

    def counting_native(self, *args, **kw):
        native_calls[0] += 1
        return native_forward(self, *args, **kw)

    monkeypatch.setattr(plan_cls, "forward", counting)
    monkeypatch.setattr(decode_native.NativeBlocks, "forward", counting_native)
    return calls, native_calls
