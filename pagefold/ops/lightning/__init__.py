"""Lightning attention (MiniMax): the one entry models call. Torch forms only (:mod:`.reference`):
:func:`lightning` takes the decode form for one token per request, else the chunked form; the
naive form is the reference both are tested against."""

from __future__ import annotations

import torch

from pagefold.ops.lightning.reference import (
    lightning_chunked,
    lightning_naive,
    lightning_recurrent,
)

__all__ = ["lightning", "lightning_chunked", "lightning_naive", "lightning_recurrent"]


def lightning(*args, decode: bool, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`lightning_recurrent` when ``decode`` (one token per request), else
    :func:`lightning_chunked`; the signature of both."""
    return (lightning_recurrent if decode else lightning_chunked)(*args, **kwargs)
