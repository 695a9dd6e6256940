"""Mamba-1 selective scan: the one entry models call. Torch forms only (:mod:`.reference`):
:func:`selective_scan` takes the decode form for one token per request, else the chunked form; the
naive form is the reference both are tested against."""

from __future__ import annotations

import torch

from pagefold.ops.selective_scan.reference import (
    selective_scan_chunked,
    selective_scan_naive,
    selective_scan_recurrent,
)

__all__ = ["selective_scan", "selective_scan_chunked", "selective_scan_naive",
           "selective_scan_recurrent"]


def selective_scan(*args, decode: bool, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`selective_scan_recurrent` when ``decode`` (one token per request), else
    :func:`selective_scan_chunked`; the signature of both."""
    return (selective_scan_recurrent if decode else selective_scan_chunked)(*args, **kwargs)
