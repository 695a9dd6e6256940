"""Mamba-1 selective scan: the one entry models call. Torch forms only (:mod:`.reference`):
:func:`selective_scan` takes the verify form on a speculative verify step, the decode form for
one token per request, else the chunked form; the naive form is the reference all are tested
against."""

from __future__ import annotations

import torch

from pagefold.ops.selective_scan.reference import (
    selective_scan_chunked,
    selective_scan_naive,
    selective_scan_recurrent,
    selective_scan_verify,
)

__all__ = ["selective_scan", "selective_scan_chunked", "selective_scan_naive",
           "selective_scan_recurrent", "selective_scan_verify"]


def selective_scan(*args, decode: bool, verify: bool = False, **kwargs
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`selective_scan_verify` on a speculative verify step (the second result: the
    state after every token), else :func:`selective_scan_recurrent` when ``decode`` (one
    token per request), else :func:`selective_scan_chunked`; the signature of all three."""
    if verify:
        return selective_scan_verify(*args, **kwargs)
    return (selective_scan_recurrent if decode else selective_scan_chunked)(*args, **kwargs)
