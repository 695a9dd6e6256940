"""Model weights on transparent huge pages (Linux, CPU), for the weight stream of decode steps.

A decode step reads every weight once, and the few-row products read many rows at a time:
the AMX GEMV loads 16 weight rows per tile and keeps 4 tiles in flight, 64 rows that with
K = 3,072 bf16 columns sit on 64 or more different 4 KiB pages, more than the data TLB holds.
On 2 MiB pages they sit on a handful. Measured here (one thread, 2-core Xeon, 300 MB of
weights cycled): a 1,024 x 3,072 GEMV 7.0 -> 13.1 GB/s, 3,072 x 1,024 11.6 -> 13.0,
3,072 x 576 11.0 -> 12.4, 576 x 1,536 11.3 -> 12.7.

:func:`weights_on_huge_pages` copies every CPU parameter of at least ``min_bytes`` into one
private anonymous mapping advised ``MADV_HUGEPAGE`` (the kernel backs it with 2 MiB pages
where transparent huge pages are ``always`` or ``madvise``; under ``never`` it is ordinary
memory) and points the parameters at their copies (``param.data``): the same values, the
same parameter objects (tied weights stay tied). Call it before anything caches weight
pointers (``cpu_ops.use_fast_linears``). The paged cache's byte tensors come from
:func:`zeros` (decode attention streams them the same way). ``PAGEFOLD_HUGE_PAGES=0`` turns
both off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import sys

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_ALIGN = 4096  # each weight starts on its own (small) page


def _madvise():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _enabled() -> bool:
    return os.environ.get("PAGEFOLD_HUGE_PAGES", "1") != "0" and sys.platform.startswith("linux")


def _arena(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` of zeroed uint8 memory starting on a huge-page boundary of a private anonymous
    mapping advised ``MADV_HUGEPAGE`` (kept alive by the tensor), or None when refused."""
    madvise = _madvise()
    if madvise is None:
        return None
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError) as e:
        logger.info("ordinary pages: %s", e)
        return None
    anchor = ctypes.c_char.from_buffer(region)
    addr = ctypes.addressof(anchor)
    del anchor  # only its address was needed (a live export would pin the mapping)
    skip = (-addr) % HUGE_PAGE
    if madvise(addr + skip, nbytes, _MADV_HUGEPAGE) != 0:
        logger.info("ordinary pages: madvise(MADV_HUGEPAGE) failed (errno %d)",
                    ctypes.get_errno())
        return None
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=skip)


def zeros(rows: int, cols: int) -> torch.Tensor:
    """A zero-filled (rows, cols) uint8 CPU tensor on huge pages where they are on (the paged
    cache's byte tensors), else ``torch.zeros``. Every page is touched here, as
    ``torch.zeros`` does, so no step pays the first-touch faults."""
    out = _arena(rows * cols) if _enabled() and rows * cols >= HUGE_PAGE else None
    if out is None:
        return torch.zeros((rows, cols), dtype=torch.uint8)
    return out.view(rows, cols).zero_()


def weights_on_huge_pages(model: torch.nn.Module, min_bytes: int = HUGE_PAGE) -> int:
    """Move ``model``'s CPU parameters of ``min_bytes`` or more onto one huge-page mapping;
    returns the bytes moved (0 when off, not Linux, nothing that large, or refused)."""
    if not _enabled():
        return 0
    params, seen = [], set()
    for p in model.parameters():
        if id(p) in seen or p.device.type != "cpu" or p.is_sparse:
            continue
        seen.add(id(p))
        if p.numel() * p.element_size() >= min_bytes and p.is_contiguous():
            params.append(p)
    if not params:
        return 0
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
    arena = _arena(total)
    if arena is None:
        return 0
    with torch.no_grad():
        for p, off in zip(params, offsets):
            n = p.numel() * p.element_size()
            dst = arena[off : off + n].view(p.dtype).view(p.shape)
            dst.copy_(p.data)
            p.data = dst
    logger.info("%d weight tensors (%.1f MiB) on transparent huge pages "
                "(PAGEFOLD_HUGE_PAGES=0 to keep them where they were)", len(params),
                total / 2**20)
    return total
