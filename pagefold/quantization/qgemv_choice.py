"""Which product each quantized weight's bf16 rows take, and up to how many rows: chosen by
measuring, as the bf16 GEMVs are (``csrc/gemv_choice``).

A GGUF weight's few-row product has up to three compiled kernels, ``q8``
(``pf_qgemv_affine_q8``: the rows quantized to int8 per group, integer dot products; group-32
codes only), ``q8mm`` (``pf_qgemm_affine_q8``: the same int8 rows on the AMX tile unit from 16
rows up, ``q8``'s form and bits below, so that a verify step of up to 15 rows keeps a decode
step's bits; CPUs with AMX-INT8 only, where it is the flags' pick) and ``float``
(``pf_qgemv_affine``: float32 sums); an integer or FP8 weight (GPTQ, AWQ,
compressed-tensors, on-load int4 / int8 / fp8) has ``int`` (``pf_qgemv_int``). Above a
kernel's rows the ``tile``
path decodes a tile of output rows to bf16 and runs oneDNN's GEMM. Which is fastest, and up to
how many rows, depends on the CPU (VNNI or not, how wide its units are), the format, the shape
and the row count, so at load :func:`choose` times, per distinct (format, N, K), each kernel at
``gemv_choice.ROWS`` rows and the tile path where it can win, with the weights streamed as a
model step streams them (every call reads the next view of the model's own weights of that
format, so a working set that fits the cache is timed hot, as a step runs it, and one that
does not is timed cold), and keeps one kernel per shape for all its rows (a verify step's rows
then have a decode step's bits) plus the row count above which the tile path takes over
(``gemv_choice.decide``: the same rule, cache file and log line as the bf16 table).

float32 rows are not chosen: they always take the float32-sum kernel (the exactness tests
hold float32 models to transformers on the decoded weights).

A weight takes part through: ``n``, ``k``, ``nbytes``, ``choice`` (set here), ``signature()``,
``kernel_names()`` (the flags' pick first), ``arrays()`` (its per-row tensors), ``twin(*arrays)``
and ``product(x, name)`` (``torch``: the tile path).

``PAGEFOLD_QGEMV``: ``auto`` (default, measured), ``flags`` (the first kernel name, up to 32
rows, untimed), ``q8`` / ``q8mm`` / ``float`` (that GGUF kernel up to 32 rows where the weight
has it, else the flags' pick), ``tile`` (no kernel: every bf16 product decodes tiles).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable

import torch

from pagefold.csrc import cpu_ops, gemv_choice, gemv_timing
from pagefold.csrc.gemv_choice import ROWS, Table

__all__ = ["MODES", "KERNEL_MAX_ROWS", "choose", "choose_for", "flags_pick", "requested"]

KERNEL_MAX_ROWS = 32
KERNELS = ("q8", "q8mm", "float")  # the ones a mode can force
TILE = "tile"
MODES = ("auto", "flags", *KERNELS, TILE)
FORMAT = 2  # 2: tables made before gemv_choice.DRIVER_COST re-made


def requested() -> str:
    """``PAGEFOLD_QGEMV`` checked (auto when unset)."""
    got = os.environ.get("PAGEFOLD_QGEMV", "").strip().lower() or "auto"
    if got not in MODES:
        raise ValueError(f"PAGEFOLD_QGEMV={got!r}: expected one of {', '.join(MODES)}")
    return got


def flags_pick(weight) -> tuple[str, int]:
    """The untimed choice: the weight's first kernel (int8 activations where a compiled form
    takes GGUF codes, on AMX tiles where the CPU has them) up to :data:`KERNEL_MAX_ROWS`
    rows."""
    return weight.kernel_names()[0], KERNEL_MAX_ROWS


def _fixed(weight) -> tuple[str, int] | None:
    mode = requested()
    if cpu_ops.kernels() is None or mode == TILE:
        return "torch", 0
    if mode in KERNELS and mode in weight.kernel_names():
        return mode, KERNEL_MAX_ROWS
    if mode != "auto":
        return flags_pick(weight)
    return None


class WeightStream:
    """(n, k) twins of the weights of one signature, each call's twin the next view of the
    model's own arrays of that signature (a view starts where the last ended; a source too
    small for the shape is passed over), so timing reads weights in the order and amount a
    model step does."""

    def __init__(self, weights: list) -> None:
        self.weights = weights
        self.at = 0
        self.pos: list[int] = [0] * len(weights[0].arrays())  # elements into each array

    def next(self, proto, n: int) -> object:
        need = [n * a.shape[1] for a in proto.arrays()]
        for _ in range(2 * len(self.weights) + 1):
            flat = [a.reshape(-1) for a in self.weights[self.at].arrays()]
            if all(p + m <= a.numel() for p, m, a in zip(self.pos, need, flat)):
                views = [a[p:p + m].view(n, -1) for p, m, a in zip(self.pos, need, flat)]
                self.pos = [p + m for p, m in zip(self.pos, need)]
                return proto.twin(*views)
            self.at, self.pos = (self.at + 1) % len(self.weights), [0] * len(need)
        return proto  # no other source holds the shape: the weight itself


def measure(proto, stream: WeightStream, kernels: list[str], deadline: float = math.inf
            ) -> tuple[Table, dict[int, float]] | None:
    """Seconds of each of ``kernels`` and of the tile path at each of ``ROWS`` rows on
    streamed twins of ``proto``; None when a machine too busy to time gave no plausible
    figure, or past ``deadline`` (a ``time.perf_counter`` value). At each row count a kernel
    whose one probing call took ``PRUNE`` times the fastest one's is not timed (inf). The
    tile path (which
    decodes the whole weight on every call) is probed once at the most rows and timed, from
    the most rows down, only while within ``PRUNE`` of the best kernel (below, a larger
    count's time bounds it: ``decide`` reads it so)."""
    try:
        return _measure_rows(proto, stream, kernels, deadline)
    except Declined:
        return None  # not this weight's kernel: it keeps the flags' choice (and its fallback)


def _measure_rows(proto, stream: WeightStream, kernels: list[str], deadline: float
                  ) -> tuple[Table, dict[int, float]] | None:
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
        got = gemv_timing.time_rows({name: (_runner(name), weights)
                                     for name in _worth_timing(kernels, x, weights)}, x, calls)
        for name in kernels:
            table[name][r] = got.get(name, math.inf)
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


def _worth_timing(kernels: list[str], x: torch.Tensor, weights: Callable[[], object]
                  ) -> list[str]:
    """The kernels to time at ``x``'s rows: a call each after an untimed one (first-call
    costs: the tile state's first use, allocations), those within ``PRUNE`` of the fastest
    (the rest are not this row count's pick: inf in the table, so ``decide`` keeps them below
    it; without this a 32-row GEMV on a large head, tens of ms a call, took the whole load's
    budget on a busy machine and no shape was ever timed)."""
    once = {}
    for name in kernels:
        _runner(name)(x, weights())
        w = weights()
        t0 = time.perf_counter()
        _runner(name)(x, w)
        once[name] = time.perf_counter() - t0
    fastest = min(once.values())
    return [name for name in kernels if once[name] <= gemv_choice.PRUNE * fastest]


class Declined(Exception):
    """A kernel refused a weight's layout (its product falls back at run time too)."""


def _runner(name: str) -> Callable[[torch.Tensor, object], object]:
    def run(x: torch.Tensor, w) -> object:
        y = w.product(x, name)
        if y is None:
            raise Declined(name)
        return y
    return run


def cache_key(sig: str, names: list[str]) -> dict:
    """The bf16 table's key (CPU model, flags, threads, build) for this signature's file."""
    return {**gemv_choice.cache_key(cpu_ops.kernels(), names), "gemm": TILE, "weights": sig,
            "qformat": FORMAT}


def choose_for(model: torch.nn.Module) -> int:
    """:func:`choose` for every quantized weight of ``model`` (its modules' ``packed``)."""
    return choose(w for m in model.modules()
                  for w in [getattr(m, "packed", None)] if hasattr(w, "product"))


def choose(weights: Iterable, timer: Callable | None = None) -> int:
    """Set every quantized weight's bf16 choice (``weight.choice``: kernel name and most rows) by
    the rule in the module doc; ``timer(proto, stream, kernels)`` replaces :func:`measure`
    (tests). Returns how many weights were chosen for."""
    weights = list({id(w): w for w in weights}.values())
    groups: dict[str, list] = {}
    for w in weights:
        fixed = _fixed(w)
        if fixed is not None:
            w.choice = fixed
        else:
            groups.setdefault(w.signature(), []).append(w)
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
    names = ws[0].kernel_names()
    stream = WeightStream(ws)
    picked = gemv_choice.measured_choices(
        sorted(protos), cache_key(sig, names), incumbent,
        lambda s: timer(protos[s], stream, names),
        nbytes=lambda s: protos[s].nbytes, what=f"qgemv ({sig})", above="tile decode + GEMM",
        budget_s=budget_s)
    for w in ws:
        w.choice = picked[(w.n, w.k)]
