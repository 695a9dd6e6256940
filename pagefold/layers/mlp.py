"""Feed-forward blocks shared by the models: gated (SwiGLU / GeGLU) and ungated MLPs."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pagefold.distributed.parallel_state import tp_size
from pagefold.layers.activations import get_activation, relu2
from pagefold.layers.linear import column_linear, row_linear
from pagefold.layers.native_record import Step, linears, matrix_shape
from pagefold.ops import elementwise


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``; gate and up are one fused ``gate_up_proj`` (checkpoint
    ``gate_proj`` / ``up_proj`` rows). ``reduce=False``: under tensor parallelism return this
    rank's partial sum (an MoE block sums its experts' partials with one all-reduce)."""

    def __init__(self, hidden: int, inter: int, bias: bool = False, act: str = "silu",
                 reduce: bool = True, what: str = "intermediate_size") -> None:
        super().__init__()
        if inter % tp_size():
            raise ValueError(f"{what} ({inter}) is not divisible by "
                             f"tensor_parallel_size {tp_size()}")
        self.inter = inter // tp_size()  # this rank's share
        self.gate_up_proj = column_linear(hidden, {"gate_proj": inter, "up_proj": inter},
                                          bias=bias, what=what)
        self.down_proj = row_linear(inter, hidden, bias=bias, what=what, reduce=reduce)
        self.act = get_activation(act, ("silu", "gelu", "gelu_pytorch_tanh"), "MLP activation")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        h = elementwise.silu_and_mul(gate_up) if self.act is F.silu else None
        if h is None:
            gate, up = gate_up.split(self.inter, dim=-1)
            h = self.act(gate) * up
        return self.down_proj(h)

    def native_record(self, hidden: int) -> tuple | None:
        """The native decode step's record: gate_up, ``pf_silu_mul``, down (SiLU only)."""
        lin = linears(self.gate_up_proj, self.down_proj, hidden, self.inter)
        if self.act is not F.silu or lin is None or lin["n0"] != 2 * self.inter:
            return None
        return "mlp_silu", lin, {}

    def native_dyn(self, step: Step) -> list[int]:
        return []


class UngatedMLP(nn.Module):
    """``down_proj(act(up_proj(x)))`` (Nemotron-H's relu^2 MLP); ``reduce`` as in GatedMLP."""

    def __init__(self, hidden: int, inter: int, bias: bool, act: str, reduce: bool = True,
                 what: str = "intermediate_size") -> None:
        super().__init__()
        self.up_proj = column_linear(hidden, inter, bias=bias, what=what)
        self.down_proj = row_linear(inter, hidden, bias=bias, what=what, reduce=reduce)
        self.act = get_activation(act, ("relu2", "silu", "swish", "relu"), "MLP activation")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))

    def native_record(self, hidden: int) -> tuple | None:
        """The native decode step's record for relu^2 (``pf_relu2`` rounds as torch does)."""
        lin = linears(self.up_proj, self.down_proj, hidden, matrix_shape(self.up_proj)[0])
        if self.act is not relu2 or lin is None:
            return None
        return "mlp_relu2", lin, {}

    def native_dyn(self, step: Step) -> list[int]:
        return []
