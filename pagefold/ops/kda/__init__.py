"""Kimi Delta Attention (KDA): the one entry models call. Torch forms only (:mod:`.reference`):
:func:`kda` takes the decode form for one token per request, else the chunked form; the
naive form is the reference both are tested against."""

from __future__ import annotations

import torch

from pagefold.ops.kda.reference import (
    kda_chunked,
    kda_naive,
    kda_recurrent,
    l2norm,
)

__all__ = ["kda", "kda_chunked", "kda_naive", "kda_recurrent", "l2norm"]


def kda(*args, decode: bool, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kda_recurrent` when ``decode`` (one token per request), else
    :func:`kda_chunked`; the signature of both."""
    return (kda_recurrent if decode else kda_chunked)(*args, **kwargs)
