"""The engine side of tensor parallelism: N worker ranks driven by the step message.

``TPExecutor`` stands where the single-process ``ModelRunner`` stands in ``EngineCore``: the
scheduler (in the engine process) makes each step's message, the executor sends the same
bytes to every rank (``submit``) and returns the sampling rank's tokens (``collect``): rank 0;
under pipeline parallelism tensor-parallel rank 0 of the last stage (``worker.sampling_rank``),
with several messages in flight, answered in order. Ranks rendezvous over ``env://``
(``MASTER_ADDR`` / ``MASTER_PORT``; a free local port by default).

Failure: while waiting, the executor watches every rank's process. A rank that exits or
reports an error ends the engine with ``TPWorkerError`` naming the rank (its peers, blocked in
a collective, are stopped), so a dead worker is an error within a second, never a hang.
"""

from __future__ import annotations

import os
import pickle
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from multiprocessing.connection import Listener

from pagefold.core.kv_connector import ReportMerger
from pagefold.core.sched_output import RunnerOutput, SampledToken, SchedulerOutput
from pagefold.distributed.worker import WorkerInit, sampling_rank


class TPWorkerError(RuntimeError):
    """A tensor-parallel rank died or failed; the engine cannot continue."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: list, conns: list) -> None:
    for c in conns:
        try:
            c.send_bytes(b"")
        except Exception:  # noqa: BLE001
            pass
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(max(0.01, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
    for c in conns:
        c.close()


class TPExecutor:
    POLL_S = 0.2

    def __init__(self, init: WorkerInit, size: int, *, start_timeout_s: float = 600.0) -> None:
        """Start ``size`` worker processes (``python -m pagefold.distributed.worker``: no
        re-import of the caller's main module) and wait until every rank holds its shard."""
        self.size = size
        self._sampler = sampling_rank(size, init.pipeline_parallel_size)
        self._error: str | None = None
        authkey = secrets.token_bytes(16)
        self._dir = tempfile.TemporaryDirectory(prefix="pagefold-tp-")
        address = os.path.join(self._dir.name, "engine.sock")
        listener = Listener(address, family="AF_UNIX", authkey=authkey)
        env = dict(os.environ, MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                   MASTER_PORT=os.environ.get("MASTER_PORT") or str(_free_port()),
                   WORLD_SIZE=str(size), PAGEFOLD_TP_AUTHKEY=authkey.hex())
        env["PYTHONPATH"] = os.pathsep.join(p for p in [os.path.dirname(os.path.dirname(
            os.path.dirname(os.path.abspath(__file__)))), env.get("PYTHONPATH", "")] if p)
        self.procs: list[subprocess.Popen] = [
            subprocess.Popen([sys.executable, "-m", "pagefold.distributed.worker", address,
                              str(rank), str(size)], env=dict(env, RANK=str(rank)))
            for rank in range(size)]
        self.conns: list = [None] * size
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)
        try:
            self._accept_all(listener, start_timeout_s)
        finally:
            listener.close()
        for c in self.conns:
            c.send(init)
        self.num_forward_tokens = 0
        self._reports = ReportMerger(size)  # the ranks' KV connector reports
        replies = self._collect(start_timeout_s)
        self.rank_params: list[int] = [r[1] for r in replies]  # per rank: its shard
        self.weight_elements = sum(self.rank_params)  # shards (replicated norms count twice)
        self.rank_pools: list[dict] = [r[2] for r in replies]  # per rank: blocks, pool bytes
        # Every rank's state layers take checkpoints inside their kernels (see ModelRunner).
        self.captures_in_kernel = all(r[3] for r in replies)
        # Every rank built and loaded a vision tower (image inputs run replicated).
        self.takes_images = all(r[4] for r in replies)

    def _accept_all(self, listener: Listener, timeout_s: float) -> None:
        """Each rank connects and names itself; a rank that exits first fails the start."""
        sock = listener._listener._socket  # accept in short waits to watch the processes
        sock.settimeout(0.5)
        deadline = time.monotonic() + timeout_s
        while any(c is None for c in self.conns):
            try:
                conn = listener.accept()
                self.conns[conn.recv()] = conn
            except TimeoutError:
                pass
            for rank, p in enumerate(self.procs):
                if self.conns[rank] is None and p.poll() is not None:
                    self._fail(f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with "
                               f"code {p.returncode} before connecting")
            if time.monotonic() > deadline:
                self._fail(f"tensor-parallel workers did not connect within {timeout_s:.0f} s")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _fail(self, msg: str) -> None:
        self._error = msg
        self.close()
        raise TPWorkerError(msg)

    def _collect(self, timeout_s: float | None = None) -> list[tuple]:
        """One reply per rank, in rank order; raises ``TPWorkerError`` when a rank dies or
        reports an error (or, with ``timeout_s``, stays silent that long)."""
        replies: list[tuple | None] = [None] * self.size
        start = time.monotonic()
        while any(r is None for r in replies):
            # Wait (briefly, to watch the processes) on the first rank yet to answer, never
            # spin: under pipeline parallelism the last stage answers long after the first.
            first = replies.index(None)
            for rank, (p, c) in enumerate(zip(self.procs, self.conns)):
                if replies[rank] is not None:
                    continue
                try:
                    ready = c.poll(self.POLL_S if rank == first else 0)
                    msg = c.recv() if ready else None
                except (EOFError, OSError):
                    msg = None
                    ready = True
                if msg is not None:
                    if msg[0] == "error":
                        self._blame_dead(exclude=rank, then=msg[1])
                        self._fail(f"tensor-parallel worker {msg[1]}")
                    replies[rank] = msg
                elif ready or p.poll() is not None:
                    try:
                        code = p.wait(0.5)
                    except subprocess.TimeoutExpired:
                        code = None
                    self._fail(f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with "
                               f"code {code}; the engine cannot continue")
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                self._fail(f"tensor-parallel workers did not answer within {timeout_s:.0f} s")
        return replies  # type: ignore[return-value]

    def _blame_dead(self, exclude: int, then: str, wait_s: float = 1.0) -> None:
        """A rank reported an error: when another rank died, that death is the cause (the
        reporter's collective failed because its peer vanished), so name the dead rank."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, p in enumerate(self.procs):
                # A rank that reported an error itself exits with 0; a killed one does not.
                if rank != exclude and p.poll() not in (None, 0):
                    first = then.splitlines()[0] if then else ""
                    self._fail(f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with "
                               f"code {p.returncode}; the engine cannot continue (then {first})")
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)

    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        """Run one step message on every rank and return the sampling rank's tokens."""
        self.submit(out)
        return self.collect(out)

    def submit(self, out: SchedulerOutput) -> None:
        """Send ``out`` to every rank without waiting (pipeline parallelism keeps several in
        flight: every rank runs its messages in order and answers each in turn)."""
        if not self.procs:
            raise TPWorkerError(self._error or "the tensor-parallel workers were shut down")
        data = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, c in enumerate(self.conns):
            try:
                c.send_bytes(data)
            except (BrokenPipeError, OSError):
                self._fail(f"tensor-parallel worker rank {rank} (pid {self.procs[rank].pid}) "
                           f"is gone; the engine cannot continue")

    def collect(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        """The answers to the oldest message submitted (``out``): the sampling rank's tokens."""
        replies = self._collect()
        first = replies[self._sampler]
        self.num_forward_tokens = first[2]
        reports = [r[3] for r in replies]
        if not any(r is not None for r in reports):
            return first[1]
        result = RunnerOutput(first[1])
        result.kv_connector_output = self._reports.merge(reports, out.kv_ops.cancels)
        return result

    def close(self) -> None:
        self._finalizer()
        self.procs, self.conns = [], []
