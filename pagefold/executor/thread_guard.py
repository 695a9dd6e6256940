"""How many threads a CPU step takes when other processes may hold this host's cores.

pagefold's kernels (and torch's) split each op over OpenMP threads, and libgomp lets a thread
that finishes its share spin until its siblings finish theirs. When another process runs on
one of the cores, a parallel region waits for a thread that is off-CPU for a scheduler time
slice, and a step opens hundreds of regions: on the 2-core Xeon one busy shell loop took batch-1
decode from 84 to 3.6 tok/s and batch 32 from 1,236 to 123 (BENCHMARKS.md, "OpenMP's wait
policy"). One thread has no sibling to wait for. No spin count (``GOMP_SPINCOUNT``) or passive
waiting is free on idle cores, and libgomp reads those only at start-up.

:class:`ThreadGuard` watches the kernel's per-thread run-queue delay (``/proc/self/task/*/
schedstat``, second field: nanoseconds a runnable thread of this process waited for a CPU). On
free cores it stays near zero whatever the load of the step; when another process wants the
cores it grows about as fast as the wall clock. Where it passes :data:`CONTENDED` seconds per
second over a reading window, steps run on one thread; after a back-off they try the full count
again for one window: still contended doubles the back-off (up to :data:`MAX_BACKOFF_S`),
free resets it. Invariants: :meth:`ThreadGuard.threads` returns ``full`` or 1; a process where
the delay cannot be read (not Linux, no schedstat) always gets ``full``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

__all__ = ["CONTENDED", "MAX_BACKOFF_S", "ThreadGuard", "enabled", "run_queue_delay_ns"]

# Waiting seconds per wall second, summed over the process's threads, above which the host is
# taken as contended. Free cores read ~0.00-0.02 (kernel threads, timer ticks); one busy loop
# beside two spinning OpenMP threads on 2 cores reads ~0.5-1.
CONTENDED = 0.25
WINDOW_S = 0.2        # seconds between readings (a reading lists and reads a few small files)
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 32.0


def enabled() -> bool:
    """``PAGEFOLD_THREAD_GUARD`` (default on; ``0`` / ``off`` keep every step on the full
    thread count whatever the host does: for comparisons)."""
    return os.environ.get("PAGEFOLD_THREAD_GUARD", "1").strip().lower() not in ("0", "off",
                                                                                 "false", "no")


def run_queue_delay_ns(task_dir: str = "/proc/self/task") -> int | None:
    """Nanoseconds this process's live threads have waited, runnable, for a CPU (the sum of
    their schedstat's second field), or None where the kernel does not report it. A thread that
    exits takes its share with it: callers treat a fall as no wait."""
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return None
    total, seen = 0, False
    for tid in tids:
        try:
            with open(f"{task_dir}/{tid}/schedstat", "rb") as f:
                fields = f.read().split()
        except OSError:  # the thread exited between the listing and the read
            continue
        if len(fields) >= 2:
            total += int(fields[1])
            seen = True
    return total if seen else None


@dataclass(slots=True)
class ThreadGuard:
    """Per-step thread count for one process's steps (see the module docstring).
    ``sensor``/``clock`` are injectable for tests."""

    sensor: Callable[[], int | None] = run_queue_delay_ns
    clock: Callable[[], float] = time.monotonic
    window_s: float = WINDOW_S
    contended: float = CONTENDED
    reduced: bool = False        # steps on one thread now
    probing: bool = False        # the full count is being tried again after a back-off
    backoff_s: float = FIRST_BACKOFF_S
    _probe_at: float = 0.0       # when reduced: when to try the full count again
    _last_t: float | None = None
    _last_delay: int = 0
    _dead: bool = False          # no sensor here: always the full count
    last_rate: float = 0.0       # the last window's waiting, seconds per second

    def threads(self, full: int) -> int:
        """The threads the next step takes: ``full`` or 1."""
        if full <= 1 or self._dead:
            return full
        now = self.clock()
        if self._last_t is None:
            self._read(now)
        elif now - self._last_t >= self.window_s:
            self._update(now, full)
        return 1 if self.reduced else full

    def _read(self, now: float) -> float | None:
        """Takes a reading; the waiting rate since the previous one (None at the first)."""
        delay = None if self._dead else self.sensor()
        if delay is None:
            self._dead = True
            return None
        prev_t, prev = self._last_t, self._last_delay
        self._last_t, self._last_delay = now, delay
        if prev_t is None or now <= prev_t:
            return None
        return max(0, delay - prev) / 1e9 / (now - prev_t)

    def _update(self, now: float, full: int) -> None:
        rate = self._read(now)
        if rate is None:
            return
        self.last_rate = rate
        if self.reduced:
            if now >= self._probe_at:  # the next window runs on the full count
                self.reduced, self.probing = False, True
            return
        if rate > self.contended:
            if self.probing:
                self.backoff_s = min(2 * self.backoff_s, MAX_BACKOFF_S)
                log.debug("host still contended (threads waited %.2f s/s): 1 thread for %.0f s",
                          rate, self.backoff_s)
            else:
                log.info("host contended: this process's threads waited %.2f s per second for "
                         "a CPU; steps run on 1 thread instead of %d, the full count tried "
                         "again after %.0f s (PAGEFOLD_THREAD_GUARD=0 turns this off)",
                         rate, full, self.backoff_s)
            self.reduced, self.probing = True, False
            self._probe_at = now + self.backoff_s
        elif self.probing:
            log.info("host free again (threads waited %.2f s/s): steps on %d threads", rate,
                     full)
            self.probing, self.backoff_s = False, FIRST_BACKOFF_S
