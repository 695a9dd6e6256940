"""LoRA adapters on routed MoE experts' stacked weights, several adapters batched per row.

PEFT adapts a 3D expert parameter (``target_parameters=["experts.gate_up_proj", ...]``) with
one low-rank pair per expert: for expert ``e`` the weight used is ``W_e + s * B_e @ A_e``
(``A_e`` (r, in), ``B_e`` (out, r), ``in`` / ``out`` the product's own input and output
widths). pagefold adds ``s * B_e (A_e h)`` to the expert's product instead, for the rows of
the tokens routed to ``e``, each row with its own adapter slot.

A :class:`LoRAExperts` attaches to one expert stack -- a :class:`~pagefold.layers.moe.MoEExperts`
or a model's own (Granite-4.0-H's ``GraniteMoE``, gpt-oss's ``GptOssExperts``), each
describing itself with ``lora_stack()`` -- as its ``lora`` attribute (the experts, their
weights and their native record are unchanged) and holds ``num_slots`` resident adapters for
it, per local expert, stacked so that one expert's slots are one contiguous (slots, R, width)
block for the punica shrink / expand of :mod:`pagefold.ops.lora` (the torch, compiled CPU or
Triton form, as the linears use):

* ``gate_up_proj``: ``a`` (E, slots, R, hidden), ``b`` (E, slots, R, 2 * inter) -- B
  transposed with the scaling folded in, its output order the weight's: gate rows then up
  rows, or gate and up interleaved channel by channel (gpt-oss, ``ExpertsLayout.interleaved``);
* ``down_proj``: ``a`` (E, slots, R, inter), ``b`` (E, slots, R, hidden).

Inside the expert loop the experts call :meth:`LoRAExperts.rows` with the token ids routed to
expert ``e`` (the step's per-row slot index gathered at those tokens: each routed row keeps
its own token's adapter; base rows, slot -1, get nothing and keep their bits) and
:meth:`LoRAExperts.add` after each product.

Tensor parallelism (experts' intermediate dimension split): ``gate_up``'s A is whole and its B
keeps this rank's gate rows and up rows (as the weight's rows are cut: two runs, or one run of
interleaved pairs); ``down``'s A keeps this
rank's input columns, so its shrink is a partial sum, and its B is whole: the added term is a
partial sum like the expert's own output, completed by the MoE block's one all-reduce.
Expert parallelism: this rank's whole experts' adapters, uncut.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagefold.distributed.parallel_state import tp_rank
from pagefold.layers.lora_linear import LoRAStep
from pagefold.ops import lora as lora_ops

PARAMS = ("gate_up_proj", "down_proj")  # transformers' registration order (PEFT's nesting)


@dataclass(frozen=True)
class ExpertsLayout:
    """A LoRA-able expert stack: ``total`` experts in the checkpoint, this rank's
    ``[first, first + count)``; ``hidden``; the full intermediate width and this rank's;
    ``interleaved``: gate_up's outputs alternate gate and up per channel (gpt-oss) rather than
    all gate outputs then all up outputs."""

    total: int
    first: int
    count: int
    hidden: int
    inter_full: int
    inter_local: int
    interleaved: bool = False

    def widths(self, param: str) -> tuple[int, int]:
        """(in, out) of one expert's full ``param`` product (PEFT's ``in_features`` /
        ``out_features``)."""
        if param == "gate_up_proj":
            return self.hidden, 2 * self.inter_full
        return self.inter_full, self.hidden


class LoRAExperts:
    """The resident adapters of one expert stack (see the module docstring)."""

    def __init__(self, experts: nn.Module, layout: ExpertsLayout, like: torch.Tensor,
                 step: LoRAStep, *, num_slots: int, max_rank: int) -> None:
        """``experts``: the stack (its ``lora`` attribute is set); ``like``: a tensor of the
        dtype and device the adapters' matrices take (one of its weights)."""
        self.layout = layout
        self.step = step
        self.rank = max_rank
        w = like
        n, h, i = layout.count, layout.hidden, layout.inter_local
        widths = {"gate_up_proj": (h, 2 * i), "down_proj": (i, h)}
        self.a = {p: torch.zeros(n, num_slots, max_rank, widths[p][0], dtype=w.dtype,
                                 device=w.device) for p in PARAMS}
        self.b = {p: torch.zeros(n, num_slots, max_rank, widths[p][1], dtype=w.dtype,
                                 device=w.device) for p in PARAMS}
        experts.lora = self

    def clear_slot(self, slot: int) -> None:
        for p in PARAMS:
            self.a[p][:, slot].zero_()
            self.b[p][:, slot].zero_()

    def set_part(self, slot: int, part: str, a_full: torch.Tensor, b_full: torch.Tensor) -> None:
        """Place one parameter's full per-expert ``a_full`` (E, r, in) and scaled ``b_full``
        (E, out, r) into ``slot``: this rank's experts, cut as their weights are."""
        lay = self.layout
        a = a_full.narrow(0, lay.first, lay.count)
        b = b_full.narrow(0, lay.first, lay.count)
        if lay.inter_local != lay.inter_full:  # tensor parallelism: this rank's inter share
            lo, n = tp_rank() * lay.inter_local, lay.inter_local
            if part == "gate_up_proj" and lay.interleaved:  # channel j: outputs 2j, 2j + 1
                b = b.narrow(1, 2 * lo, 2 * n)
            elif part == "gate_up_proj":
                b = torch.cat([b.narrow(1, lo, n), b.narrow(1, lay.inter_full + lo, n)], dim=1)
            else:
                a = a.narrow(2, lo, n)
        r = a.shape[1]
        self.a[part][:, slot, :r].copy_(a)
        self.b[part][:, slot, :r].copy_(b.transpose(1, 2))

    def rows(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The slot of each routed row (its token's), or None when no row of the step has an
        adapter (the experts then run as without LoRA)."""
        idx = self.step.idx
        return None if idx is None else idx.index_select(0, tokens)

    def add(self, e: int, part: str, x: torch.Tensor, y: torch.Tensor,
            idx: torch.Tensor) -> None:
        """``y += s * B_e (A_e x)`` in place on the adapter rows of local expert ``e``'s
        ``part`` product (``x`` its input rows, ``y`` its output rows)."""
        v = lora_ops.shrink(x, self.a[part][e], idx)
        lora_ops.expand_(y, v, self.b[part][e], idx)
