"""Lightning attention (MiniMax): the one entry models call. Torch forms only (:mod:`.reference`):
:func:`lightning` takes the verify form on a speculative verify step, the decode form for one
token per request, else the chunked form; the naive form is the reference all are tested
against."""

from __future__ import annotations

import torch

from pagefold.ops.lightning.reference import (
    lightning_chunked,
    lightning_naive,
    lightning_recurrent,
    lightning_verify,
)

__all__ = ["lightning", "lightning_chunked", "lightning_naive", "lightning_recurrent",
           "lightning_verify"]


def lightning(*args, decode: bool, verify: bool = False, **kwargs
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`lightning_verify` on a speculative verify step (the second result: the state after
    every token), else :func:`lightning_recurrent` when ``decode`` (one token per request), else
    :func:`lightning_chunked`; the signature of all three."""
    if verify:
        return lightning_verify(*args, **kwargs)
    return (lightning_recurrent if decode else lightning_chunked)(*args, **kwargs)
