"""Kimi Delta Attention (KDA): the one entry models call. Torch forms only (:mod:`.reference`):
:func:`kda` takes the verify form on a speculative verify step, the decode form for one token
per request, else the chunked form; the naive form is the reference all are tested against."""

from __future__ import annotations

import torch

from pagefold.ops.kda.reference import (
    kda_chunked,
    kda_naive,
    kda_recurrent,
    kda_verify,
    l2norm,
)

__all__ = ["kda", "kda_chunked", "kda_naive", "kda_recurrent", "kda_verify", "l2norm"]


def kda(*args, decode: bool, verify: bool = False, **kwargs
       ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kda_verify` on a speculative verify step (the second result: the state after
    every token), else :func:`kda_recurrent` when ``decode`` (one token per request), else
    :func:`kda_chunked`; the signature of all three."""
    if verify:
        return kda_verify(*args, **kwargs)
    return (kda_recurrent if decode else kda_chunked)(*args, **kwargs)
