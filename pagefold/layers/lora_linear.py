"""LoRA adapters on a model's linears, several adapters batched in one step (punica-style).

A :class:`LoRALinear` attaches to one linear layer of the model (a forward hook: the layer,
its weights and its native decode record are unchanged) and holds ``num_slots`` resident
adapters' matrices for it:

* ``a`` (slots, P * R, in): per checkpoint part ``p`` of the layer (``q_proj`` / ``k_proj`` /
  ``v_proj`` of a fused ``qkv_proj``; one part for an unfused layer), rows ``p*R:(p+1)*R``
  hold that part's A (zero rows past its rank);
* ``b`` (slots, P * R, out): the part's B transposed, scaling folded in, in its own ``R``
  rows and the part's output columns; zero elsewhere (a part the adapter leaves alone is all
  zero). Transposed so that the expand runs along contiguous outputs.

The step's per-row slot index lives in the model-wide :class:`LoRAStep` the runner fills
before each forward; while it holds no adapter row (``idx is None``) the hook returns at once.
Otherwise ``y += expand(shrink(x))`` on the adapter rows only (:mod:`pagefold.ops.lora`);
base rows keep their bits.

Tensor parallelism: a column-parallel layer's ``a`` is the full A (its input is whole on every
rank) and ``b`` this rank's output rows of B (cut as the layer's rows are); a row-parallel
layer's ``a`` is this rank's input columns of A, the shrink's partial sums are all-reduced
(a (rows, P*R) tensor) and ``b`` is the whole B on every rank. A row-parallel layer that
returns partial sums (``reduce=False``, summed by its caller) adds its partial LoRA term
without the all-reduce: the caller's sum is the full term.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from pagefold.distributed.parallel_state import all_reduce, tp_rank
from pagefold.ops import lora as lora_ops


@dataclass
class LoRAStep:
    """The current step's rows: ``idx`` (rows,) int64 slot per row (-1: base), or None when
    no row of the step uses an adapter."""

    idx: torch.Tensor | None = None


@dataclass
class PartLayout:
    """Where one checkpoint part of a linear sits: its local output rows ``(offset, rows)``
    and, under tensor parallelism, how its full rows are cut (``cut.take``; None: whole)."""

    offset: int
    rows: int
    full_rows: int
    cut: object | None = None


@dataclass
class LinearLayout:
    """A LoRA-able linear: ``kind`` "column" (input whole), "row" (input cut over the ranks)
    or "replicated"; the full input width and its parts by checkpoint name."""

    kind: str
    in_local: int
    in_full: int
    parts: dict[str, PartLayout] = field(default_factory=dict)
    reduce: bool = True


class LoRALinear:
    """The resident adapters of one linear (see the module docstring)."""

    def __init__(self, linear: nn.Linear, layout: LinearLayout, step: LoRAStep, *,
                 num_slots: int, max_rank: int) -> None:
        self.layout = layout
        self.step = step
        self.rank = max_rank
        self.part_index = {name: i for i, name in enumerate(layout.parts)}
        w = linear.weight
        width = len(layout.parts) * max_rank
        self.a = torch.zeros(num_slots, width, layout.in_local, dtype=w.dtype, device=w.device)
        self.b = torch.zeros(num_slots, width, w.shape[0], dtype=w.dtype, device=w.device)
        self.handle = linear.register_forward_hook(self._hook)

    def clear_slot(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def set_part(self, slot: int, part: str, a_full: torch.Tensor, b_full: torch.Tensor) -> None:
        """Place one part's full (checkpoint-shaped) ``a_full`` (r, in) and scaled ``b_full``
        (rows, r) into ``slot``, cutting them as this rank's layer is cut."""
        lay = self.layout
        p = self.part_index[part]
        pl = lay.parts[part]
        r = a_full.shape[0]
        c0 = p * self.rank
        a = a_full
        if lay.kind == "row" and lay.in_local != lay.in_full:
            a = a_full.narrow(1, tp_rank() * lay.in_local, lay.in_local)
        b = b_full if pl.cut is None else pl.cut.take(b_full)
        self.a[slot, c0 : c0 + r].copy_(a)
        self.b[slot, c0 : c0 + r, pl.offset : pl.offset + pl.rows].copy_(b.T)

    def _hook(self, module: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor | None:
        idx = self.step.idx
        if idx is None:
            return None
        x = inputs[0]
        v = lora_ops.shrink(x, self.a, idx)
        if self.layout.kind == "row" and self.layout.reduce:
            v = all_reduce(v)
        lora_ops.expand_(out, v, self.b, idx)
        return out
