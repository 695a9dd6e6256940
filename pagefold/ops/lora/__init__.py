"""Punica-style batched LoRA: one step's rows each carry the slot of their adapter.

``a`` stacks every slot's down-projection, (slots, R, in); ``b`` every slot's
up-projection with the scaling folded in, transposed: (slots, R, out) (the expand then runs
along contiguous outputs); ``idx`` (rows,) int64 is each row's slot, -1 for a row of the
base model (no adapter).

* :func:`shrink` -> ``v`` (rows, R) float32: ``x[i] @ a[idx[i]].T``, zeros for base rows.
* :func:`expand_` adds ``v[i] @ b[idx[i]]`` to ``y[i]`` in place, rounded once to ``y``'s
  dtype; base rows are never written (their bits stay the base model's).

Triton (:mod:`.triton`) where it is selected for the tensors' device (GPU), else the compiled
CPU kernels (``csrc/lora.cpp``) where they take the inputs; elsewhere the torch form of
:mod:`.reference`, one product per slot present in the step.
"""

from __future__ import annotations

import torch

from pagefold.kernels import dispatch
from pagefold.ops.lora import cpu, reference

__all__ = ["expand_", "shrink"]


def _fast(device: torch.device):
    """The Triton module when it is selected for ``device``, else the compiled CPU one."""
    if not dispatch.use_triton(device):
        return cpu
    from pagefold.ops.lora import triton as lora_triton

    return lora_triton


def shrink(x: torch.Tensor, a: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    v = _fast(x.device).shrink(x, a, idx)
    return reference.shrink(x, a, idx) if v is None else v


def expand_(y: torch.Tensor, v: torch.Tensor, b: torch.Tensor, idx: torch.Tensor) -> None:
    if not _fast(y.device).expand_(y, v, b, idx):
        reference.expand_(y, v, b, idx)
