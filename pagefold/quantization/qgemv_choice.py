"""Which product each GGUF weight's bf16 rows take, and up to how many rows: chosen by
measuring, as the bf16 GEMVs are (``csrc/gemv_choice``).

A GGUF weight's few-row product has two compiled kernels: ``q8`` (``pf_qgemv_affine_q8``: the
rows quantized to int8 per group, integer dot products; group-32 codes only) and ``float``
(``pf_qgemv_affine``: float32 sums), and above their rows the ``tile`` path (decode a tile of
output rows to bf16, then oneDNN's GEMM). Which is fastest depends on the CPU (VNNI or not,
how wide its units are), the weight's format and shape, and the row count, so at load
:func:`choose` times, per distinct (format, N, K), both kernels at ``gemv_choice.ROWS`` rows
and the tile path where it can win, with the weights streamed as a model step streams them
(every call reads the next view of the model's own weights of that format, so a working set
that fits the cache is timed hot, as a step runs it, and one that does not is timed cold), and
keeps one kernel per shape for all its rows (a verify step's rows then have a decode step's
bits) plus the row count above which the tile path takes over (``gemv_choice.decide``, the
same rule, cache file and log line as the bf16 table).

float32 rows are not chosen: they always take ``float`` (the exactness tests hold float32
models to transformers on the decoded weights).

``PAGEFOLD_QGEMV``: ``auto`` (default, measured), ``flags`` (``q8`` where it takes the codes,
else ``float``, both up to 32 rows, untimed), ``q8`` or ``float`` (that kernel up to 32 rows;
``q8`` where it takes the codes), ``tile`` (no kernel: every bf16 product decodes tiles).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable

import torch

from pagefold.csrc import cpu_ops, gemv_choice, gemv_timing
from pagefold.csrc.gemv_choice import ROWS, Table

__all__ = ["MODES", "KERNEL_MAX_ROWS", "choose", "flags_pick", "requested"]

KERNEL_MAX_ROWS = 32
KERNELS = ("q8", "float")
TILE = "tile"
MODES = ("auto", "flags", *KERNELS, TILE)
FORMAT = 1


def requested() -> str:
    """``PAGEFOLD_QGEMV`` checked (auto when unset)."""
    got = os.environ.get("PAGEFOLD_QGEMV", "").strip().lower() or "auto"
    if got not in MODES:
        raise ValueError(f"PAGEFOLD_QGEMV={got!r}: expected one of {', '.join(MODES)}")
    return got


def _q8_takes(weight) -> bool:
    lib = cpu_ops.kernels()
    return (lib is not None and weight.group == 32
            and bool(lib.pf_qgemv_q8_takes(weight.bits)))


def flags_pick(weight) -> tuple[str, int]:
    """The untimed choice: int8 activations where a compiled form takes the codes."""
    return ("q8" if _q8_takes(weight) else "float"), KERNEL_MAX_ROWS


def _fixed(weight) -> tuple[str, int] | None:
    mode = requested()
    if cpu_ops.kernels() is None or mode == TILE:
        return "torch", 0
    if mode in ("flags", "q8"):
        return flags_pick(weight)
    if mode == "float":
        return "float", KERNEL_MAX_ROWS
    return None


def signature(weight) -> str:
    """What besides (N, K) decides a product's speed: code bits, group, scale width."""
    return f"affine b{weight.bits} g{weight.group} {str(weight.scale.dtype)[6:]}"


class WeightStream:
    """(n, k) twins of the GGUF weights of one signature, each call's twin the next view of
    the model's own codes, scales and mins of that signature (a view starts where the last
    ended; a source too small for the shape is passed over), so timing reads weights in the
    order and amount a model step does."""

    def __init__(self, weights: list) -> None:
        self.weights = weights
        self.at = 0
        self.pos = [0, 0]  # codes bytes, scale elements into the current source

    def next(self, proto, n: int) -> object:
        per_row = proto.codes.shape[1], proto.scale.shape[1]
        need = n * per_row[0], n * per_row[1]
        for _ in range(2 * len(self.weights) + 1):
            src = self.weights[self.at]
            c, s = src.codes.reshape(-1), src.scale.reshape(-1)
            if self.pos[0] + need[0] <= c.numel() and self.pos[1] + need[1] <= s.numel():
                c0, s0 = self.pos
                self.pos = [c0 + need[0], s0 + need[1]]
                return proto.twin(c[c0:c0 + need[0]].view(n, -1),
                                  s[s0:s0 + need[1]].view(n, -1),
                                  src.min.reshape(-1)[s0:s0 + need[1]].view(n, -1))
            self.at, self.pos = (self.at + 1) % len(self.weights), [0, 0]
        return proto  # no other source holds the shape: the weight itself


def measure(proto, stream: WeightStream, kernels: list[str], deadline: float = math.inf
            ) -> tuple[Table, dict[int, float]] | None:
    """Seconds of each of ``kernels`` and of the tile path at each of ``ROWS`` rows on
    streamed twins of ``proto``; None when a machine too busy to time gave no plausible
    figure, or past ``deadline`` (a ``time.perf_counter`` value). The tile path (which
    decodes the whole weight on every call) is probed once at the most rows and timed, from
    the most rows down, only while within ``PRUNE`` of the best kernel (below, a larger
    count's time bounds it: ``decide`` reads it so)."""
    n, k = proto.n, proto.k
    calls = gemv_timing.calls_for(proto.nbytes)
    g = torch.Generator().manual_seed(n * 131 + k)
    table: Table = {name: {} for name in kernels}
    tile: dict[int, float] = dict.fromkeys(ROWS, float("inf"))
    tile_alive = None  # unknown until the probe

    def weights() -> object:
        return stream.next(proto, n)

    for r in sorted(ROWS, reverse=True):
        if time.perf_counter() > deadline:
            return None
        x = torch.randn(r, k, generator=g).bfloat16()
        got = gemv_timing.time_rows({name: (_runner(name), weights) for name in kernels}, x,
                                    calls)
        for name in kernels:
            table[name][r] = got[name]
        best = min(got.values())
        if tile_alive is None:  # one call: a decode of the whole weight is no GEMV's match
            t0 = time.perf_counter()
            _runner(TILE)(x, weights())
            tile_alive = time.perf_counter() - t0 <= gemv_choice.PRUNE * best
        if tile_alive:
            tile[r] = gemv_timing.time_rows({TILE: (_runner(TILE), weights)}, x, calls)[TILE]
            tile_alive = tile[r] <= gemv_choice.PRUNE * best
        if not gemv_choice.plausible(min(best, tile[r]), proto.nbytes):
            return None
    return table, tile


def _runner(name: str) -> Callable[[torch.Tensor, object], object]:
    def run(x: torch.Tensor, w) -> object:
        y = w.product(x, name)
        if y is None:
            raise RuntimeError(f"the {name} kernel declined a timing product")
        return y
    return run


def cache_key(sig: str, names: list[str]) -> dict:
    """The bf16 table's key (CPU model, flags, threads, build) for this signature's file."""
    return {**gemv_choice.cache_key(cpu_ops.kernels(), names), "gemm": TILE, "weights": sig,
            "qformat": FORMAT}


def choose(weights: Iterable, timer: Callable | None = None) -> int:
    """Set every GGUF weight's bf16 choice (``weight.choice``: kernel name and most rows) by
    the rule in the module doc; ``timer(proto, stream, kernels)`` replaces :func:`measure`
    (tests). Returns how many weights were chosen for."""
    weights = list({id(w): w for w in weights}.values())
    groups: dict[str, list] = {}
    for w in weights:
        fixed = _fixed(w)
        if fixed is not None:
            w.choice = fixed
        else:
            groups.setdefault(signature(w), []).append(w)
    # One load's budget for all of them, the signature of the largest weight first.
    deadline = time.perf_counter() + gemv_choice.BUDGET_S
    def timed(proto, stream: WeightStream, kernels: list[str]):
        return measure(proto, stream, kernels, deadline)

    for sig, ws in sorted(groups.items(), key=lambda g: -max(w.nbytes for w in g[1])):
        _choose_group(sig, ws, timer or timed, max(0.0, deadline - time.perf_counter()))
    return len(weights)


def _choose_group(sig: str, ws: list, timer: Callable, budget_s: float) -> None:
    """One signature's weights: one cache file, one stream over its weights."""
    protos = {(w.n, w.k): w for w in ws}
    incumbent = flags_pick(ws[0])
    names = [incumbent[0]] + (["float"] if incumbent[0] == "q8" else [])
    stream = WeightStream(ws)
    picked = gemv_choice.measured_choices(
        sorted(protos), cache_key(sig, names), incumbent,
        lambda s: timer(protos[s], stream, names),
        nbytes=lambda s: protos[s].nbytes, what=f"qgemv ({sig})", above="tile decode + GEMM",
        budget_s=budget_s)
    for w in ws:
        w.choice = picked[(w.n, w.k)]
