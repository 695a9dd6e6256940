"""``model_runner.step_inference_mode``: ``@torch.inference_mode()`` through its C++ guard."""

from __future__ import annotations

import pytest
import torch

from pagefold.executor.model_runner import step_inference_mode


def test_step_inference_mode_is_the_decorators_mode_for_the_call_only():
    """Inside: inference mode on and new tensors inference tensors, as under
    ``@torch.inference_mode()``; outside, and after an exception, the mode as it was; the
    result, the name and nesting inside ``inference_mode(False)`` are kept."""
    seen = []

    @step_inference_mode
    def step(x: int) -> int:
        seen.append((torch.is_inference_mode_enabled(), torch.ones(1).is_inference()))
        if x < 0:
            raise ValueError("negative")
        return x + 1

    @torch.inference_mode()
    def reference() -> tuple[bool, bool]:
        return torch.is_inference_mode_enabled(), torch.ones(1).is_inference()

    assert step(2) == 3 and step.__name__ == "step"
    assert seen == [reference()] == [(True, True)]
    assert not torch.is_inference_mode_enabled() and not torch.ones(1).is_inference()
    with pytest.raises(ValueError):
        step(-1)
    assert not torch.is_inference_mode_enabled()
    with torch.inference_mode(False):
        assert step(0) == 1 and seen[-1] == (True, True)
        assert not torch.is_inference_mode_enabled()
