"""Timing bf16 products as a model step sees them: weights streamed from memory.

A decode step reads every weight once, and a model's weights exceed the last-level cache, so
each product reads its weight from memory; a benchmark that calls one weight in a loop times
it hot in cache instead, where the ranking of the kernels differs (a dot-product GEMV that
wins on a 576x576 weight in L2 loses by 2x on a 56 MB head streamed, on a core that splits
512-bit work). :class:`StreamPool` lays weight copies one after another in a buffer larger
than the last-level cache and hands out the next copy on every call, so each call reads bytes
that were evicted since it last read them. :func:`time_rows` times one path at one row count
(the least of several such calls, the paths taking turns).
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagefold.csrc import gemm

MIB = 1 << 20
# The buffer: twice the last-level cache, at least 64 MiB, at most PAGEFOLD_GEMV_STREAM_MIB
# (default 256: a VM may report a whole socket's cache; the cap bounds load-time memory).
MIN_STREAM = 64 * MIB
_LINE = 32  # bf16 elements per 64-byte line: every copy starts on a line
# Calls per measurement: enough bytes to average the noise of a shared machine, few enough
# that a model's shapes time in about a second.
TARGET_BYTES = 12 * MIB
MIN_CALLS, MAX_CALLS = 3, 10
ROUNDS_S = 0.04  # past MIN_CALLS rounds, no more rounds once one row count took this long


def llc_bytes() -> int:
    """The largest CPU cache's size (Linux sysfs), 32 MiB when it cannot be read."""
    best = 0
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        for idx in base.glob("index*"):
            text = (idx / "size").read_text().strip()
            mult = {"K": 1 << 10, "M": MIB, "G": 1 << 30}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KMG")) * mult)
    except (OSError, ValueError):
        pass
    return best or 32 * MIB


def stream_bytes() -> int:
    cap = int(os.environ.get("PAGEFOLD_GEMV_STREAM_MIB", "256")) * MIB
    return max(MIN_STREAM, min(2 * llc_bytes(), cap))


class StreamPool:
    """(n, k) bf16 weight views handed out in turn from ``sources`` (the model's own weights:
    resident already, on huge pages where the model's are, and their real values), topped up
    with a buffer of random values when they total less than ``nbytes`` (default
    :func:`stream_bytes`). Each call's view starts where the previous one ended (the next
    source that holds it), so a view is read again only after the whole pool went by. A
    weight larger than every source gets a buffer of its own holding two copies."""

    def __init__(self, sources: list[torch.Tensor] | None = None,
                 nbytes: int | None = None) -> None:
        want = nbytes or stream_bytes()
        srcs = [t.detach().reshape(-1) for t in sources or ()
                if t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous()]
        have = sum(2 * t.numel() for t in srcs)
        if have < want:
            srcs.append(_filled((want - have) // 2))
        self.srcs = srcs
        self.nbytes = sum(2 * t.numel() for t in srcs)
        self.at, self.pos = 0, 0
        self.big: dict[tuple[int, int], torch.Tensor] = {}
        self.flip = 0

    def next(self, n: int, k: int) -> torch.Tensor:
        """The next (n, k) view, contiguous."""
        need = n * k
        if all(t.numel() < need for t in self.srcs):
            own = self.big.get((n, k))
            if own is None:
                own = self.big[(n, k)] = _filled(2 * need)
            self.flip ^= 1
            return own[self.flip * need: (self.flip + 1) * need].view(n, k)
        while self.pos + need > self.srcs[self.at].numel():
            self.at, self.pos = (self.at + 1) % len(self.srcs), 0
        start = self.pos
        self.pos += -(-need // _LINE) * _LINE  # the next view starts a line further on
        return self.srcs[self.at][start: start + need].view(n, k)


def _filled(numel: int) -> torch.Tensor:
    """``numel`` bf16 values in [-0.5, 0.5) (the first touch of fresh pages is most of the
    cost: on a busy machine ~1 s per 100 MiB, hence the model's weights first)."""
    g = torch.Generator().manual_seed(0)
    pattern = (torch.rand(1 << 16, generator=g) - 0.5).bfloat16()
    rows = -(-numel // pattern.numel())
    buf = torch.empty(rows * pattern.numel(), dtype=torch.bfloat16)
    buf.view(rows, -1).copy_(pattern.expand(rows, -1))
    return buf[:numel]


def calls_for(nbytes: int) -> int:
    return max(MIN_CALLS, min(MAX_CALLS, TARGET_BYTES // max(nbytes, 1)))


def time_rows(paths: dict[str, tuple[Callable, Callable[[], object]]], x: torch.Tensor,
              calls: int, budget_s: float = ROUNDS_S) -> dict[str, float]:
    """Seconds of each path's ``run(x, w)``, ``paths`` name -> ``(run, weights)``, each call
    on the next weight from its ``weights``: the least over ``calls`` rounds (a busy machine
    only adds time: preemption, a neighbour's traffic) in which the paths take turns, so a
    burst of noise hits all of them; after one untimed round (first-call costs are not a
    step's). Past :data:`MIN_CALLS` rounds, no round starts after ``budget_s``."""
    best = dict.fromkeys(paths, math.inf)
    t_start = time.perf_counter()
    for i in range(calls + 1):
        if i > MIN_CALLS and time.perf_counter() - t_start > budget_s:
            break  # a busy machine: enough rounds for a least time, within the load budget
        for name, (run, weights) in paths.items():
            w = weights()
            t0 = time.perf_counter()
            run(x, w)
            dt = time.perf_counter() - t0
            if i:
                best[name] = min(best[name], dt)
    return best


def gemv_runner(fn) -> Callable[[torch.Tensor, torch.Tensor], object]:
    """``run(x, w)`` for a compiled GEMV (``pf_linear_bf16``'s arguments), its output
    allocated per call as the model path allocates it; raises when the kernel declines."""
    def run(x: torch.Tensor, w: torch.Tensor) -> None:
        n, k = w.shape
        m = x.shape[0]
        y = torch.empty((m, n), dtype=torch.bfloat16)
        if fn(x.data_ptr(), x.stride(0), w.data_ptr(), None, y.data_ptr(), n, m, n, k,
              torch.get_num_threads()) != 0:
            raise RuntimeError("the GEMV declined a timing product")
    return run


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` reordered once into oneDNN's blocked layout (``F.linear`` reorders on every
    call), or None where this torch has no such reorder."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    except (AttributeError, RuntimeError):
        return None


def gemm_path() -> str:
    """What a routed linear runs above its GEMV rows here: ``upcast`` (the float32-upcast GEMM,
    ``gemm.py``, on CPUs without native bf16 GEMM), else ``onednn`` (the pre-reordered
    weight)."""
    return "upcast" if gemm.upcast_enabled() else "onednn"


# Reordered copies per shape for timing oneDNN: reordering costs more than a product, so the
# copies cover at most this many bytes (then they cycle; the head's two copies still stream).
PACKED_BYTES = 32 * MIB


def gemm_source(path: str, n: int, k: int, pool: StreamPool
                ) -> tuple[Callable[[torch.Tensor, torch.Tensor], object], Callable[[], object]]:
    """``(run, weights)`` for :func:`time_rows` on the GEMM path ``path`` and an (n, k)
    weight: the upcast GEMM (``F.linear`` below its ``MIN_ROWS``, as the routed linear) on
    streamed copies, or oneDNN on reordered copies."""
    if path == "upcast":
        def run_up(x: torch.Tensor, w: torch.Tensor) -> object:
            y = gemm.linear(x, w)
            return torch.nn.functional.linear(x, w) if y is None else y
        return run_up, lambda: pool.next(n, k)
    copies = max(2, min(8, PACKED_BYTES // max(2 * n * k, 1)))
    packed = [prepack(pool.next(n, k)) for _ in range(copies)]
    if any(p is None for p in packed):
        plain = itertools.cycle([pool.next(n, k) for _ in range(copies)])
        return torch.nn.functional.linear, lambda: next(plain)
    cyc = itertools.cycle(packed)

    def run_dnn(x: torch.Tensor, wp: torch.Tensor) -> object:
        return torch.ops.mkldnn._linear_pointwise(x, wp, None, "none", [], "")
    return run_dnn, lambda: next(cyc)
