"""The thread guard: steps drop to one thread while other processes hold the host's cores.

The policy is driven with a fake clock and a fake run-queue sensor; the real sensor is read
from a fake ``/proc/self/task`` tree and, once, from this process while busy-loop processes
oversubscribe the cores; the runner's ``_threads_for`` is checked to apply the guard's count
for the step and restore the caller's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from pagefold.executor import thread_guard as tg
from pagefold.executor.model_runner import SMALL_STEP_WORK, _threads_for


class FakeHost:
    """A clock and a run-queue delay that grows at ``wait`` seconds per second."""

    def __init__(self) -> None:
        self.t = 100.0
        self.delay_ns = 0
        self.wait = 0.0
        self.reads = 0

    def clock(self) -> float:
        return self.t

    def sensor(self) -> int:
        self.reads += 1
        return self.delay_ns

    def advance(self, dt: float) -> None:
        self.t += dt
        self.delay_ns += int(self.wait * dt * 1e9)


def guard_on(host: FakeHost) -> tg.ThreadGuard:
    return tg.ThreadGuard(sensor=host.sensor, clock=host.clock)


def run_steps(guard: tg.ThreadGuard, host: FakeHost, seconds: float, full: int = 2,
              step_s: float = 0.05) -> list[int]:
    """The thread counts of the steps over ``seconds`` of steps ``step_s`` long."""
    counts = []
    for _ in range(round(seconds / step_s)):
        counts.append(guard.threads(full))
        host.advance(step_s)
    return counts


def test_free_host_keeps_every_thread_and_reads_once_a_window():
    host = FakeHost()
    host.wait = 0.05  # kernel threads, timer ticks
    guard = guard_on(host)
    assert set(run_steps(guard, host, 10.0)) == {2}
    # one reading per window (0.2 s; 0.25 where the float clock falls just short), not per
    # step (200 steps)
    assert 39 <= host.reads <= 51
    assert guard.last_rate == pytest.approx(0.05, rel=0.05)


def test_contention_drops_to_one_thread_within_a_window_and_probes_with_backoff():
    host = FakeHost()
    guard = guard_on(host)
    assert run_steps(guard, host, 1.0) == [2] * 20
    host.wait = 0.8
    counts = run_steps(guard, host, 0.4)
    assert counts[:4] == [2] * 4 and counts[-1] == 1  # the reading after one window
    assert guard.reduced and guard.backoff_s == tg.FIRST_BACKOFF_S
    # One thread until the back-off (1 s) ends, then the full count for one probe window.
    counts = run_steps(guard, host, 1.6)
    first_probe = counts.index(2)
    assert 0.75 <= first_probe * 0.05 <= 1.25 and set(counts[:first_probe]) == {1}
    # The probe found the host still taken: one thread again, for twice as long.
    assert counts[-1] == 1 and guard.backoff_s == 2 * tg.FIRST_BACKOFF_S
    second = run_steps(guard, host, 3.0)
    assert second.count(2) <= 5 and second[-1] == 1
    assert guard.backoff_s == 4 * tg.FIRST_BACKOFF_S


def test_backoff_is_capped_and_a_free_probe_resets_it():
    host = FakeHost()
    host.wait = 1.0
    guard = guard_on(host)
    run_steps(guard, host, 200.0, step_s=0.1)
    assert guard.backoff_s == tg.MAX_BACKOFF_S
    host.wait = 0.0  # the other work ended: the next probe keeps the full count
    counts = run_steps(guard, host, tg.MAX_BACKOFF_S + 2, step_s=0.1)
    assert counts[-5:] == [2] * 5
    assert not guard.reduced and guard.backoff_s == tg.FIRST_BACKOFF_S
    assert set(run_steps(guard, host, 5.0, step_s=0.1)) == {2}


def test_one_thread_steps_and_hosts_without_the_sensor_are_left_alone():
    host = FakeHost()
    host.wait = 1.0
    guard = guard_on(host)
    assert set(run_steps(guard, host, 2.0, full=1)) == {1}
    assert host.reads == 0
    dead = tg.ThreadGuard(sensor=lambda: None, clock=host.clock)
    assert set(run_steps(dead, host, 2.0)) == {2}


def test_a_thread_exiting_is_not_read_as_waiting():
    host = FakeHost()
    guard = guard_on(host)
    run_steps(guard, host, 0.5)
    host.delay_ns -= 5 * 10**9  # an exited thread took its 5 s of waiting with it
    assert set(run_steps(guard, host, 1.0)) == {2}
    assert guard.last_rate == 0.0


def test_sensor_sums_the_wait_field_of_every_thread(tmp_path):
    for tid, line in (("11", "900000000 250 7\n"), ("12", "5 1000 2\n"), ("13", "1 2\n")):
        (tmp_path / tid).mkdir()
        (tmp_path / tid / "schedstat").write_text(line)
    (tmp_path / "14").mkdir()  # exited between the listing and the read: no file
    assert tg.run_queue_delay_ns(str(tmp_path)) == 250 + 1000 + 2
    assert tg.run_queue_delay_ns(str(tmp_path / "missing")) is None


@pytest.mark.skipif(not os.path.exists(f"/proc/self/task/{os.getpid()}/schedstat"),
                    reason="the kernel reports no schedstat here")
def test_real_sensor_sees_this_process_wait_when_the_cores_are_oversubscribed():
    cpus = len(os.sched_getaffinity(0))
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(2 * cpus)]
    try:
        time.sleep(0.3)  # the loops are running
        d0, t0 = tg.run_queue_delay_ns(), time.monotonic()
        while time.monotonic() - t0 < 1.0:  # this thread runnable throughout
            pass
        rate = (tg.run_queue_delay_ns() - d0) / 1e9 / (time.monotonic() - t0)
    finally:
        for lp in loops:
            lp.kill()
            lp.wait()
    # 2 * cpus + 1 runnable threads on cpus cores: this one waits ~half the time.
    assert rate > tg.CONTENDED


def test_enabled_reads_the_environment(monkeypatch):
    monkeypatch.delenv("PAGEFOLD_THREAD_GUARD", raising=False)
    assert tg.enabled()
    for off in ("0", "off", "False"):
        monkeypatch.setenv("PAGEFOLD_THREAD_GUARD", off)
        assert not tg.enabled()
    monkeypatch.setenv("PAGEFOLD_THREAD_GUARD", "1")
    assert tg.enabled()


class _Fixed:
    def __init__(self, n: int | None) -> None:
        self.n = n
        self.asked: list[int] = []

    def threads(self, full: int) -> int:
        self.asked.append(full)
        return full if self.n is None else self.n


def test_threads_for_applies_the_guard_for_the_step_and_restores():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cpu, big = torch.device("cpu"), SMALL_STEP_WORK * 4
        reduced = _Fixed(1)
        with _threads_for(cpu, big, reduced):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2 and reduced.asked == [2]
        free = _Fixed(None)
        with _threads_for(cpu, big, free):
            assert torch.get_num_threads() == 2
        with _threads_for(cpu, SMALL_STEP_WORK // 2, free):  # small steps: one thread anyway
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2 and free.asked == [2]
        with _threads_for(cpu, big):  # no guard (the profile run)
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
