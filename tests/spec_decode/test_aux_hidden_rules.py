"""The target-side seam of the hidden-state drafters (``spec_decode/aux_hidden.py``) without a
model (issue 44: mutmut over ``spec_decode/``): EAGLE-3's default layers, finding the decoder
stack and its embedding, and the layer-id check with its exact message. Expected values are
worked out by hand from vLLM's documented default ``(2, n // 2, n - 3)`` clamped into
``[0, n - 1]``."""

from __future__ import annotations

import pytest
from torch import nn

from pagefold.spec_decode.aux_hidden import (
    check_aux_layers,
    default_aux_layer_ids,
    target_embedding,
    target_stack,
)


@pytest.mark.parametrize("n, want", [
    (32, (2, 16, 29)),  # a real target: vLLM's default unchanged
    (6, (2, 3, 3)),     # the smallest target where nothing is clamped
    (4, (2, 2, 1)),     # n - 3 = 1
    (3, (2, 1, 0)),     # n - 3 = 0: the lower clamp's edge
    (2, (1, 1, 0)),     # 2 clamped down to the top layer, -1 up to 0
    (1, (0, 0, 0)),
])
def test_default_aux_layers_are_vllms_clamped_into_the_target(n: int, want) -> None:
    got = default_aux_layer_ids(n)
    assert got == want
    assert isinstance(got, tuple)


class _Stack(nn.Module):
    def __init__(self, n: int, captures: bool = True) -> None:
        super().__init__()
        self.captures_layer_inputs = captures
        self.token_embedding = nn.Embedding(7, 3)
        self.layers = nn.ModuleList(nn.Identity() for _ in range(n))


class _Target(nn.Module):
    def __init__(self, *children: nn.Module) -> None:
        super().__init__()
        for i, c in enumerate(children):
            self.add_module(f"c{i}", c)


def test_the_stack_is_the_child_that_captures_its_layers_inputs() -> None:
    plain, off, stack = nn.Linear(2, 2), _Stack(2, captures=False), _Stack(3)
    model = _Target(plain, off, stack)
    assert target_stack(model) is stack
    assert target_embedding(model) is stack.token_embedding
    # The first capturing child wins.
    other = _Stack(5)
    assert target_stack(_Target(stack, other)) is stack


def test_a_target_without_a_capturing_stack_is_refused_by_name() -> None:
    with pytest.raises(ValueError) as e:
        target_stack(_Target(nn.Linear(2, 2), _Stack(2, captures=False)))
    assert str(e.value) == ("_Target has no decoder stack that hands its layers' inputs to a "
                            "drafter (EAGLE / MTP need one)")
    with pytest.raises(ValueError, match="^_Target has no decoder stack"):
        target_embedding(_Target())


@pytest.mark.parametrize("ids", [(0, 1, 3), (3,), (), (2, 2, 0)])
def test_layers_inside_the_target_pass(ids) -> None:
    assert check_aux_layers(_Target(_Stack(4)), ids) is None


@pytest.mark.parametrize("ids, bad", [((0, 4, 1), 4), ((-1,), -1), ((1, 2, 9), 9)])
def test_a_layer_outside_the_target_is_named(ids, bad: int) -> None:
    with pytest.raises(ValueError) as e:
        check_aux_layers(_Target(_Stack(4)), ids)
    assert str(e.value) == (f"eagle_aux_hidden_state_layer_ids names layer {bad}; the target "
                            f"has layers 0..3")
