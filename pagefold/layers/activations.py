"""Activation functions by their config names (``hidden_act``, ``mlp_hidden_act``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Activation = Callable[[torch.Tensor], torch.Tensor]


def relu2(x: torch.Tensor) -> torch.Tensor:
    # Squared in place in relu's fresh output: the same bits, one activation-sized buffer less.
    return F.relu(x).square_()


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS: dict[str, Activation] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "relu": F.relu,
    "relu2": relu2,
}


def get_activation(name: str, allowed: tuple[str, ...] | None = None,
                   what: str = "activation") -> Activation:
    """The function for ``name``; a ValueError naming the supported ones otherwise."""
    names = allowed or tuple(_ACTIVATIONS)
    if name not in names or name not in _ACTIVATIONS:
        raise ValueError(f"unsupported {what} {name!r}; supported: {', '.join(names)}")
    return _ACTIVATIONS[name]
