"""Which GEMV each bf16 weight shape takes, and up to how many rows: chosen by measuring.

CPU flags do not say which few-row product is fastest (a core may run 512-bit instructions on
256-bit units; a GEMV that wins on a weight hot in cache loses on one streamed from memory),
so at load :func:`choose` times, for each of a model's distinct (N, K) weight shapes, every
candidate this CPU and build can run (:mod:`.gemv_registry`, each past its self-check) at
:data:`ROWS` rows with weights streamed from memory (:mod:`.gemv_timing`), against the GEMM
path that takes larger products (oneDNN on reordered weights, or the float32-upcast GEMM where
the CPU lacks native bf16). It keeps per shape ONE kernel for all its GEMV rows (a verify
step's rows then have a decode step's bits) and the row count above which the GEMM path takes
over, scored by :func:`decide`: time relative to the best path at each row count, weighted
towards 1-2 rows (most steps are batch-1 decode), the flags' choice kept unless another is at
least ``1 / KEEP`` faster overall and a second measurement agrees, so noise does not flip
kernels. Row counts a choice would send to the GEMM path that the flags' choice keeps on its
GEMV count :data:`DRIVER_COST` times the GEMM path's time: the native decode driver runs a
step on the GEMVs only up to the fewest rows any of the model's linears takes, so a lower
limit on one shape costs every layer of those steps, which timing one shape does not see. A
shape whose fastest path never read its weight at :data:`MIN_BANDWIDTH` (every call
preempted) keeps the flags' choice for the rest of the process and is timed again when a
later process loads.

The table is cached as JSON under ``<pagefold cache>/gemv/`` keyed by the CPU model, its
flags, the thread count, the kernel build and the runnable kernels; a later load reads it (no
timing). A corrupt, truncated or foreign file (other CPU, build or kernels) is ignored and
rewritten, with a log line. Weights under :data:`MIN_TIMED_BYTES_BF16` (the call, not the
kernel, would be timed; noise would decide) and shapes past the load's :data:`BUDGET_S` take
the flags' choice (the largest weights are timed first).

Overrides, each about the GEMV only (the GEMM path above its rows is unchanged):
``PAGEFOLD_GEMV=<kernel>`` or the engine option ``cpu_gemv_kernel`` (which wins) force one
kernel with its hand-measured row limit (``Candidate.default_rows``); ``flags`` takes the
flags' choice without timing; ``torch`` no GEMV at all; ``auto`` (default) measures. An
unknown name, or a kernel this machine cannot run, raises with the list it can.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from pagefold.csrc import build, gemv_registry, gemv_timing
from pagefold.csrc.gemv_registry import Candidate

logger = logging.getLogger("pagefold")

ROWS = (1, 2, 4, 8, 16, 32)
# Most steps are batch-1 decode; verify steps and decode batches come next.
ROW_WEIGHT = {1: 4.0, 2: 2.0, 4: 1.0, 8: 1.0, 16: 1.0, 32: 1.0}
KEEP = 0.9  # another (kernel, rows) replaces the flags' one only when it costs <= 0.9 of it
# A row count under the flags' limit that a choice sends to the GEMM path counts this many times
# the GEMM path's time: there the native decode driver hands the step to the per-layer path
# (it runs the GEMVs only up to the fewest rows any linear takes). Measured (AMX Xeon, 2
# threads): noise-level 1-2 row readings gave (fma, 1-4) on 6,144 x 1,024 or 3,072 x 1,024 in
# some builds' tables, and such a build's `tput` ran 0.81-0.91x of one that kept (amx, 32) (the
# same code with the kernel forced in both: 0.99-1.01x).
DRIVER_COST = 1.5
PRUNE = 3.0  # a kernel this much slower than the best at some rows is not timed at more
# Weights under these many bytes take the flags' choice untimed: the quantized formats' tables
# (``quantization/qgemv_choice``) 256 KiB, the bf16 GEMVs' 1 MiB. At 256 KiB - 1 MiB of bf16
# every kernel's time is mostly the call (512 x 256: 26-40 us for all of them, 1 to 32 rows),
# and the choices flipped between two builds of the same sources on one host (fma for 1 row on
# some shapes, AMX on others); one (fma, 1) shape cost a tiny model 4-17% of its throughput
# (gdn-h256-l4, moe-h512-l8 `tput`; the native decode driver's coupling, see DRIVER_COST).
MIN_TIMED_BYTES = 256 << 10
MIN_TIMED_BYTES_BF16 = 1 << 20
BUDGET_S = 2.0
# Below this a product's least time is a preemption, not a measurement (any machine that runs
# a model reads memory at several GB/s).
MIN_BANDWIDTH = 1e9
FORMAT = 3  # 2: tables cached under the 256 KiB threshold re-made; 3: before DRIVER_COST
TORCH = "torch"  # no GEMV: every product takes the GEMM path
MODES = ("auto", "flags", TORCH)
GEMM = " gemm"  # the GEMM path's key while timing (no kernel has a space)

Table = dict[str, dict[int, float]]  # path name -> rows -> seconds (inf: not timed)
# (shape, kernels by name, the flags' kernel) -> the timings, or None (too busy to time)
Timer = Callable[[tuple[int, int], dict[str, object], str],
                 tuple[Table, dict[int, float]] | None]


@dataclass(frozen=True)
class Choice:
    """A weight shape's GEMV: the kernel's name, the most rows it takes (above: the GEMM
    path), the ctypes function, its float32-output twin (or None) and the function's address
    (for the compiled drivers). ``name == "torch"``: no GEMV (``max_rows`` 0, ``fn`` None)."""

    name: str
    max_rows: int
    fn: object = None
    f32: object = None
    address: int = 0


NO_GEMV = Choice(TORCH, 0)
_forced: list[str | None] = [None]  # the engine option (set_forced)
# By cache path: (the file's choices and those measured since, the shapes this process gave
# the flags' choice untimed: past the budget or too busy). Both hold for the process's life, so
# every model it loads computes with the same kernels (bits); clearing it is a new process.
_memo: dict[str, tuple[dict[tuple[int, int], tuple[str, int]],
                       dict[tuple[int, int], tuple[str, int]]]] = {}
_available: dict[int, list[Candidate]] = {}


def check_option(name: str) -> str:
    """``name`` lower-cased when it is one of :data:`MODES` or a kernel name (whether this
    machine runs it is checked at load, where the error lists the ones it does)."""
    got = name.strip().lower()
    if got not in MODES + gemv_registry.NAMES:
        raise ValueError(f"cpu_gemv_kernel must be one of "
                         f"{', '.join(MODES + gemv_registry.NAMES)}, got {name!r}")
    return got


def set_forced(name: str | None) -> None:
    """The engine option ``cpu_gemv_kernel`` for this process (None: ``PAGEFOLD_GEMV``, else
    auto). Checked against this machine at the next :func:`choose`."""
    _forced[0] = check_option(name) if name is not None else None


def requested() -> str:
    """The mode or kernel asked for: the engine option, else ``PAGEFOLD_GEMV``, else auto."""
    return _forced[0] or os.environ.get("PAGEFOLD_GEMV", "").strip().lower() or "auto"


def available(lib: ctypes.CDLL | None) -> list[Candidate]:
    """The candidates that run here and pass their self-check (checked once per library)."""
    if lib is None:
        return []
    got = _available.get(id(lib))
    if got is None:
        got = _available[id(lib)] = gemv_registry.available(lib)
    return got


def make_choice(lib: ctypes.CDLL, name: str, rows: int) -> Choice:
    """The :class:`Choice` of kernel ``name`` (a registry name, or ``torch``) for ``rows``."""
    if name == TORCH:
        return NO_GEMV
    c = gemv_registry.by_name(name)
    fn = getattr(lib, c.symbol)
    return Choice(name, rows, fn, getattr(lib, c.f32_symbol) if c.f32_symbol else None,
                  ctypes.cast(fn, ctypes.c_void_p).value or 0)


def monotone(times: dict[int, float]) -> dict[int, float]:
    """``times`` (rows -> seconds) with each value lowered to the least at as many rows or
    more (the suffix minimum over :data:`ROWS`)."""
    out, low = {}, math.inf
    for r in reversed(ROWS):
        low = min(low, times[r])
        out[r] = low
    return out


def decide(table: Table, gemm_times: dict[int, float],
           incumbent: tuple[str, int] | None) -> tuple[str, int]:
    """The (kernel, rows) of least weighted relative cost over :data:`ROWS`, a row count
    costing the kernel's time up to its rows and the GEMM path's above (times
    :data:`DRIVER_COST` up to ``incumbent``'s rows); ``incumbent`` (the flags' choice) is kept
    unless the best costs at most :data:`KEEP` of it. Kernels take at least 1 row; (``torch``,
    0) when the table has no kernel."""
    if not table:
        return TORCH, 0
    # A product of more rows reads the same weight and computes more: its time bounds the
    # time of fewer rows from above, so a slower reading at fewer rows was noise.
    table = {name: monotone(t) for name, t in table.items()}
    gemm_times = monotone(gemm_times)
    best = {r: min([gemm_times[r]] + [t[r] for t in table.values()]) for r in ROWS}
    floor = incumbent[1] if incumbent is not None else 0

    def cost(name: str, limit: int) -> float:
        t = table[name]
        total = 0.0
        for r in ROWS:
            v = t[r] if r <= limit else gemm_times[r] * (DRIVER_COST if r <= floor else 1.0)
            total += ROW_WEIGHT[r] * v / best[r]
        return total

    options = [(name, limit) for name in table for limit in ROWS
               if all(math.isfinite(table[name][r]) for r in ROWS if r <= limit)]
    if not options:
        return TORCH, 0
    pick = min(options, key=lambda o: cost(*o))
    if incumbent is not None and incumbent[0] in table:
        kept = cost(*incumbent)
        if math.isfinite(kept) and cost(*pick) > KEEP * kept:
            return incumbent
    return pick


def plausible(seconds: float, nbytes: int) -> bool:
    """Whether the fastest path's time for a product reading ``nbytes`` of weights can be a
    measurement rather than a preemption: at least :data:`MIN_BANDWIDTH` bytes/s, plus a
    fixed allowance for call overheads."""
    return seconds <= nbytes / MIN_BANDWIDTH + 2e-4


class StreamTimer:
    """The default timer of :func:`choose`: :func:`measure` on a :class:`.StreamPool` over
    ``sources``, made at the first shape timed (none when every shape is cached)."""

    def __init__(self, sources: list[torch.Tensor] | None, deadline: float = math.inf) -> None:
        self.sources, self.pool, self.deadline = sources, None, deadline
        self.gemm_path = gemv_timing.gemm_path()

    def __call__(self, shape: tuple[int, int], kernels: dict[str, object], keep: str
                 ) -> tuple[Table, dict[int, float]] | None:
        if self.pool is None:
            self.pool = gemv_timing.StreamPool(self.sources)
        return measure(shape, kernels, self.pool, self.gemm_path, keep, self.deadline)


def measure(shape: tuple[int, int], kernels: dict[str, object], pool: gemv_timing.StreamPool,
            gemm_path: str, keep: str | None = None, deadline: float = math.inf
            ) -> tuple[Table, dict[int, float]] | None:
    """Time every kernel of ``kernels`` (name -> ctypes function) and the GEMM path at
    :data:`ROWS` on streamed (N, K) weights; a kernel :data:`PRUNE` times slower than the best
    at some rows is not timed at more (inf), but ``keep`` (the flags' choice, the one to
    beat) always is. None when even the fastest path's least time at some row count is not
    :func:`plausible` (every call was preempted: a machine too busy to time on), or when
    ``deadline`` (a ``time.perf_counter`` value) passes before the last row count."""
    n, k = shape
    calls = gemv_timing.calls_for(2 * n * k)
    g = torch.Generator().manual_seed(n * 131 + k)
    gemm_src = gemv_timing.gemm_source(gemm_path, n, k, pool)

    def stream() -> torch.Tensor:
        return pool.next(n, k)

    runs = {name: (gemv_timing.gemv_runner(fn), stream) for name, fn in kernels.items()}
    table: Table = {name: {} for name in kernels}
    gemm_times: dict[int, float] = {}
    alive = list(kernels)
    for r in ROWS:
        if time.perf_counter() > deadline:
            return None
        x = torch.randn(r, k, generator=g).bfloat16()
        got = gemv_timing.time_rows({**{nm: runs[nm] for nm in alive}, GEMM: gemm_src}, x,
                                    calls)
        gemm_times[r] = got.pop(GEMM)
        for name in kernels:
            table[name][r] = got.get(name, math.inf)
        fastest = min(got.values(), default=math.inf)
        fastest = min(fastest, gemm_times[r])
        if not plausible(fastest, 2 * n * k):
            return None
        alive = [nm for nm in alive if nm == keep or table[nm][r] <= PRUNE * fastest]
    return table, gemm_times


def cache_key(lib: ctypes.CDLL | None, names: list[str]) -> dict:
    return {"format": FORMAT, "cpu": build.cpu_model(),
            "flags": hashlib.sha256(build.cpu_flags().encode()).hexdigest()[:16],
            "threads": torch.get_num_threads(), "build": build.build_id(),
            "kernels": names, "gemm": gemv_timing.gemm_path()}


def cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return build.cache_root() / "gemv" / f"choice-{digest}.json"


def read_cache(path: Path, key: dict) -> dict[tuple[int, int], tuple[str, int]] | None:
    """The cached choices, or None (with a log line when a file was there) where the file is
    missing, unreadable, not this key's, or names a kernel or row count not runnable here."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data["key"] != key:
            raise ValueError("written for another CPU, build or thread count")
        out = {}
        for shape, ent in data["shapes"].items():
            n, k = (int(v) for v in shape.split("x"))
            name, rows = ent["kernel"], ent["rows"]
            if (name not in key["kernels"] + [TORCH] or type(rows) is not int
                    or not (0 if name == TORCH else 1) <= rows <= gemv_registry.MAX_ROWS):
                raise ValueError(f"entry {shape} names {name!r} for {rows!r} rows")
            out[(n, k)] = (name, rows)
        return out
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        logger.warning("gemv: ignoring the choice cache %s (%s); it will be rewritten", path, e)
        return None


def write_cache(path: Path, key: dict, choices: dict[tuple[int, int], tuple[str, int]],
                times: dict[tuple[int, int], dict]) -> None:
    """Write atomically (a concurrent reader sees the old file or the new one)."""
    shapes = {f"{n}x{k}": {"kernel": c[0], "rows": c[1], "us": times.get((n, k), {})}
              for (n, k), c in sorted(choices.items())}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "shapes": shapes}, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("gemv: cannot write the choice cache %s: %s", path, e)


def _resolve_forced(mode: str, cands: list[Candidate]) -> str | None:
    """The forced kernel's name, None for auto / flags; raises for a name not runnable."""
    if mode in ("auto", "flags"):
        return None
    names = [c.name for c in cands]
    if mode == TORCH or mode in names:
        return mode
    raise ValueError(f"GEMV kernel {mode!r} (PAGEFOLD_GEMV / cpu_gemv_kernel) is not one this "
                     f"machine runs; choose one of: {', '.join(names + list(MODES))}")


def _fixed(lib: ctypes.CDLL | None, cands: list[Candidate]) -> tuple[str, int] | None:
    """The (kernel, rows) every shape takes without timing: forced, ``flags``, or none to
    run; None in auto mode."""
    mode = requested()
    forced = _resolve_forced(mode, cands)
    if not cands or forced == TORCH:
        return TORCH, 0
    if forced is not None:
        return forced, gemv_registry.by_name(forced).default_rows
    if mode == "flags":
        return flags_pick(cands)
    return None


def flags_pick(cands: list[Candidate]) -> tuple[str, int]:
    """The flags' (kernel, rows) among ``cands`` (non-empty)."""
    name = gemv_registry.flag_default([c.name for c in cands]) or cands[0].name
    return name, gemv_registry.by_name(name).default_rows


def base_choice(lib: ctypes.CDLL | None) -> Choice:
    """The choice without timing: forced, else the flags' (products no model routed)."""
    cands = available(lib)
    fixed = _fixed(lib, cands)
    return make_choice(lib, *(fixed or flags_pick(cands)))


def choose(lib: ctypes.CDLL | None, shapes: Iterable[tuple[int, int]], *,
           sources: list[torch.Tensor] | None = None, timer: Timer | None = None,
           check: Callable[[Candidate, ctypes.CDLL], bool] | None = None
           ) -> dict[tuple[int, int], Choice]:
    """Every (N, K) of ``shapes`` -> its :class:`Choice` (see the module doc), timed on
    views of ``sources`` (the model's weights, :class:`.gemv_timing.StreamPool`). ``timer``
    replaces :class:`StreamTimer` and ``check`` the self-check (tests)."""
    shapes = sorted(set(shapes))
    cands = (gemv_registry.available(lib, check) if check is not None else available(lib))
    fixed = _fixed(lib, cands)
    if fixed is not None:
        return {s: make_choice(lib, *fixed) for s in shapes}
    names = [c.name for c in cands]
    incumbent = flags_pick(cands)
    kernels = {c.name: getattr(lib, c.symbol) for c in cands}
    timer = timer or StreamTimer(sources, time.perf_counter() + BUDGET_S)
    picked = measured_choices(
        shapes, cache_key(lib, names), incumbent, lambda s: timer(s, kernels, incumbent[0]),
        nbytes=lambda s: 2 * s[0] * s[1], what="gemv", above=gemv_timing.gemm_path(),
        min_bytes=MIN_TIMED_BYTES_BF16)
    return {s: make_choice(lib, *c) for s, c in picked.items()}


def measured_choices(shapes: list[tuple[int, int]], key: dict, incumbent: tuple[str, int],
                     timer: Callable[[tuple[int, int]], tuple[Table, dict[int, float]] | None],
                     *, nbytes: Callable[[tuple[int, int]], int], what: str, above: str,
                     budget_s: float = BUDGET_S, min_bytes: int = MIN_TIMED_BYTES
                     ) -> dict[tuple[int, int], tuple[str, int]]:
    """The rule every measured kernel table follows (the bf16 GEMVs here, the quantized
    formats' in ``quantization/qgemv_choice``): each shape's (kernel, rows) from the cache
    file of ``key``, else timed by ``timer`` and decided by :func:`decide` against
    ``incumbent`` (a change must be measured twice), the largest weights (``nbytes``) first,
    within ``budget_s``; shapes under ``min_bytes``, past the budget or on a
    machine too busy to time keep ``incumbent`` (for the rest of this process: a second model
    loaded, or the same one again, computes with the kernels of the first; timed at the next
    process's load). Logs one line, ``what`` naming the table and ``above`` the path past the
    chosen rows."""
    path = cache_path(key)
    memo_key = str(path)
    memo = _memo.get(memo_key)
    stale = False
    if memo is None:
        cached = read_cache(path, key)
        stale = cached is None and path.exists()  # ignored: rewrite it
        memo = (dict(cached or {}), {})
    known, held = memo
    # The largest weights first: they take most of a step's time.
    todo = sorted((s for s in shapes
                   if s not in known and s not in held and nbytes(s) >= min_bytes),
                  key=lambda s: -nbytes(s))
    times: dict[tuple[int, int], dict] = {}
    t0 = time.perf_counter()
    for s in todo:
        if time.perf_counter() - t0 > budget_s:
            break  # the rest keep the flags' choice in this process (held below)
        got = timer(s)
        if got is None:
            continue  # the flags' choice in this process, timed again by the next one
        table, gemm_times = got
        pick = decide(table, gemm_times, incumbent)
        if pick != incumbent:  # a change must be measured twice (noise is not cached)
            again = timer(s)
            if again is None:
                continue
            if decide(*again, incumbent) != pick:
                pick = incumbent
        known[s] = pick
        times[s] = {nm: {r: round(v * 1e6, 1) for r, v in t.items()}
                    for nm, t in {**table, "gemm": gemm_times}.items()}
    if times or stale:
        write_cache(path, key, known, times)
    held.update((s, incumbent) for s in todo if s not in known)
    _memo[memo_key] = (known, held)
    picked = {s: known.get(s) or held.get(s, incumbent) for s in shapes}
    _log(what, above, picked, len(times), len(todo) - len(times), time.perf_counter() - t0,
         path, bool(times), budget_s)
    return picked


def _log(what: str, above: str, picked: dict, measured: int, left: int, seconds: float,
         path: Path, timed: bool, budget_s: float) -> None:
    groups: dict[tuple[str, int], int] = {}
    for c in picked.values():
        groups[c] = groups.get(c, 0) + 1
    parts = []
    for (name, rows), n in sorted(groups.items(), key=lambda kv: -kv[1]):
        on = f"on {n} shape{'s' if n > 1 else ''}"
        span = "1 row" if rows == 1 else f"1-{rows} rows"
        parts.append(f"{name} for {span} {on}" if name != TORCH else f"none {on}")
    how = (f"measured {measured} shape(s) in {seconds:.2f} s, cached at {path}" if timed
           else f"nothing measured ({seconds:.2f} s)" if left
           else "no timing: cached, or weights too small to time")
    if left:
        how += (f"; {left} shape(s) kept the flags' choice: too busy a machine or past the "
                f"{budget_s:.1f} s budget, timed when a later process loads")
    logger.info("%s: %s; %s above (%s)", what, ", ".join(parts), above, how)
