"""The API process's handle on an EngineCore process (``pagefold.engine.core_proc``).

:class:`AsyncEngineClient` starts the core as a child process, talks to it over two ipc ZMQ
sockets in a private temp dir (msgpack messages from ``core_proc``), and turns its token
outputs into :class:`~pagefold.outputs.RequestOutput` with an
:class:`~pagefold.engine.output_processor.OutputProcessor` *here*, in the API process, so
detokenizing step n overlaps the core computing step n+1.

Invariants:

* every tracked request has one ``asyncio.Queue``; the background receive task puts each
  cumulative ``RequestOutput`` (or an exception) in it; a finished output is the last item
  and untracks the request at once;
* a parallel-sampling request (``n`` / ``best_of`` > 1) is tracked once, by its own id: the
  core runs its children as ``rid`` and ``rid#i``, the OutputProcessor folds their outputs
  into one ``RequestOutput`` (``outputs[i]`` per child), and an abort of ``rid`` aborts the
  whole family in the core (a stop string aborts only the child that hit it);
* a consumer that stops early (client disconnect: ``CancelledError`` / ``aclose``) aborts
  its request in the core on the way out;
* when the core dies (exit, crash report, or an internal error here) every in-flight request
  and every later call fails with :class:`EngineDeadError` -- nothing waits forever;
* :meth:`AsyncEngineClient.shutdown` leaves no child process behind (shutdown message, then
  SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pagefold.config import EngineConfig
from pagefold.engine.core_proc import (
    AbortRequests,
    AddRequest,
    Fatal,
    OutputMessage,
    Outputs,
    Ready,
    Shutdown,
    UtilityCall,
)
from pagefold.engine.output_processor import OutputProcessor
from pagefold.lora.request import LoRARequest
from pagefold.multimodal.inputs import MultiModalInputs
from pagefold.outputs import RequestOutput
from pagefold.sampling_params import SamplingParams

logger = logging.getLogger("pagefold.client")

# How often the watcher checks that the core process is alive.
_WATCH_INTERVAL = 0.2


class EngineDeadError(RuntimeError):
    """The EngineCore process is gone (or was never reachable); the server answers 503."""


class RequestRejectedError(ValueError):
    """The core refused a request (``add_request`` raised ValueError); the server answers 400."""


@dataclass
class _Tracked:
    queue: asyncio.Queue
    arrival: float
    num_prompt_tokens: int
    num_tokens: int = 0
    last_token_time: float | None = None
    n: int = 1
    max_tokens: int | None = None
    # The core's first-scheduling time and the first token's arrival (request phases).
    scheduled_time: float | None = None
    first_token_time: float | None = None


class AsyncEngineClient:
    """Spawns and drives one EngineCore process. Use from a single asyncio event loop.

    ``info`` (the core's :class:`~pagefold.engine.core_proc.Ready` handshake: pid,
    max_model_len, vocab_size, eos_token_id, pool size, groups) is set by :meth:`start`.
    ``metrics`` is an optional :class:`~pagefold.metrics.ServerMetrics`.
    """

    def __init__(self, config: EngineConfig, tokenizer=None, *, metrics=None,
                 log_level: str = "INFO", startup_timeout: float = 600.0) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.log_level = log_level
        self.startup_timeout = startup_timeout
        self.info: Ready | None = None
        self.last_stats = None
        self._processor = OutputProcessor(tokenizer)
        self._reqs: dict[str, _Tracked] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(OutputMessage)
        self._proc: subprocess.Popen | None = None
        self._tmpdir: str | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._in: zmq.Socket | None = None
        self._out: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._dead_reason: str | None = None
        self._closing = False
        self._shutdown_done: asyncio.Event | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def core_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def is_alive(self) -> bool:
        return (self._dead_reason is None and self._proc is not None
                and self._proc.poll() is None)

    @property
    def dead_reason(self) -> str | None:
        if self._dead_reason is None and self._proc is not None and self._proc.poll() is not None:
            return f"engine core process {self._proc.pid} exited with code {self._proc.returncode}"
        return self._dead_reason

    def spawn(self) -> None:
        """Start the core process now (it loads the model while this process goes on, e.g.
        loading the tokenizer). Idempotent; :meth:`start` calls it if needed."""
        if self._proc is not None:
            return
        self._tmpdir = tempfile.mkdtemp(prefix="pagefold-")
        in_addr = f"ipc://{self._tmpdir}/input"
        out_addr = f"ipc://{self._tmpdir}/output"
        self._ctx = zmq.asyncio.Context()
        self._out = self._ctx.socket(zmq.PULL)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(out_addr)
        # A plain socket for sends: with no high-water mark a NOBLOCK send only fails when no
        # core is connected, which is how a dead core shows up here.
        self._in = zmq.Context.shadow(self._ctx.underlying).socket(zmq.PUSH)
        self._in.setsockopt(zmq.SNDHWM, 0)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.bind(in_addr)
        cfg = json.dumps(dataclasses.asdict(self.config))
        cmd = [sys.executable, "-m", "pagefold.engine.core_proc", "--input", in_addr,
               "--output", out_addr, "--parent-pid", str(os.getpid()), "--config", cfg,
               "--log-level", self.log_level]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        logger.info("started EngineCore process %d", self._proc.pid)

    async def start(self) -> Ready:
        """Spawn the core (unless :meth:`spawn` did), wait for its handshake and one round
        trip. ``tokenizer`` must be set by now (it detokenizes outputs). Raises ``ValueError``
        with the core's message when the engine cannot be built, ``RuntimeError`` when the
        process dies or does not answer within ``startup_timeout`` seconds."""
        self.spawn()
        self._processor = OutputProcessor(self.tokenizer)
        try:
            self.info = await self._handshake()
        except BaseException:
            await self.shutdown(timeout=0.5)
            raise
        self._tasks = [asyncio.create_task(self._output_loop(), name="engine-outputs"),
                       asyncio.create_task(self._watch_process(), name="engine-watch")]
        # One round trip: the input connection is up once the core has answered on it.
        deadline = time.monotonic() + self.startup_timeout
        while True:
            try:
                await self.utility("ping", timeout=max(deadline - time.monotonic(), 0.1))
                return self.info
            except EngineDeadError:
                if not self.is_alive or time.monotonic() > deadline:
                    await self.shutdown(timeout=0.5)
                    raise
                await asyncio.sleep(0.01)

    async def _handshake(self) -> Ready:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if await self._out.poll(200):
                msg = self._decoder.decode(await self._out.recv())
                if isinstance(msg, Ready):
                    return msg
                if isinstance(msg, Fatal):
                    raise ValueError(msg.message)
                raise RuntimeError(f"unexpected first message from the engine core: {msg!r}")
            if self._proc.poll() is not None:
                raise RuntimeError(f"engine core process exited with code "
                                   f"{self._proc.returncode} during startup (see its log above)")
        raise RuntimeError(f"engine core did not start within {self.startup_timeout:.0f} s")

    async def shutdown(self, timeout: float = 5.0, term_timeout: float = 2.0) -> None:
        """Stop the core (shutdown message; SIGTERM after ``timeout`` s, SIGKILL
        ``term_timeout`` s later) and release everything. Every in-flight request fails with
        :class:`EngineDeadError` at once. A second call waits for the first to finish."""
        if self._closing:
            if self._shutdown_done is not None:
                await self._shutdown_done.wait()
            return
        self._closing = True
        self._shutdown_done = asyncio.Event()
        try:
            await self._shutdown(timeout, term_timeout)
        finally:
            self._shutdown_done.set()

    async def _shutdown(self, timeout: float, term_timeout: float) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down anyway
                pass
        self._fail_all(EngineDeadError("the server is shutting down"))
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                self._in.send(self._encoder.encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            if not await self._wait_exit(timeout):
                proc.terminate()
                if not await self._wait_exit(term_timeout):
                    proc.kill()
                    await self._wait_exit(5.0)
        self._close_sockets()

    async def _wait_exit(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self._proc.poll() is not None

    def kill_now(self) -> None:
        """Last-resort synchronous cleanup (no event loop needed): SIGKILL the core."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                logger.error("engine core %d did not exit after SIGKILL", self._proc.pid)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._in, self._out):
            if s is not None and not s.closed:
                s.close(linger=0)
        if self._ctx is not None and not self._ctx.closed:
            self._ctx.term()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    # ------------------------------------------------------------------ death
    def _mark_dead(self, reason: str) -> None:
        if self._dead_reason is not None or self._closing:
            return
        self._dead_reason = reason
        logger.error("%s; failing %d in-flight request(s)", reason, len(self._reqs))
        self._fail_all(EngineDeadError(reason))
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()  # a core we cannot talk to must not linger

    def _fail_all(self, err: Exception) -> None:
        for rid, t in list(self._reqs.items()):
            t.queue.put_nowait(err)
            self._processor.abort(rid)
            self._record_abort(t)
        self._reqs.clear()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)
        self._calls.clear()

    def check_alive(self) -> None:
        """Raise :class:`EngineDeadError` unless the core is up."""
        if self._closing:
            raise EngineDeadError("the server is shutting down")
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "the engine core is not running")

    async def _watch_process(self) -> None:
        while True:
            await asyncio.sleep(_WATCH_INTERVAL)
            if self._proc.poll() is not None:
                self._mark_dead(f"engine core process {self._proc.pid} exited with code "
                                f"{self._proc.returncode}")
                return

    # ------------------------------------------------------------------ messages
    def _send(self, msg) -> None:
        self.check_alive()
        try:
            self._in.send(self._encoder.encode(msg), zmq.NOBLOCK)
        except zmq.Again as e:
            raise EngineDeadError("the engine core is not connected") from e

    async def _output_loop(self) -> None:
        try:
            while True:
                msg = self._decoder.decode(await self._out.recv())
                if isinstance(msg, Outputs):
                    self._on_outputs(msg)
                elif isinstance(msg, Fatal):
                    self._mark_dead(f"engine core failed: {msg.message}")
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - never leave requests waiting on a dead loop
            logger.exception("engine output loop failed")
            self._mark_dead(f"engine output handling failed: {type(e).__name__}: {e}")

    def _on_outputs(self, msg: Outputs) -> None:
        now = time.monotonic()
        if msg.stats is not None:
            self.last_stats = msg.stats
            if self.metrics is not None:
                self.metrics.record_core_stats(msg.stats)
        for u in msg.utility:
            fut = self._calls.pop(u.call_id, None)
            if fut is not None and not fut.done():
                if u.error is not None:
                    fut.set_exception(ValueError(u.error))
                else:
                    fut.set_result(u.result)
        for err in msg.errors:
            t = self._reqs.pop(err.request_id, None)
            self._processor.abort(err.request_id)
            if t is not None:
                t.queue.put_nowait(RequestRejectedError(err.message))
        # Tokens the core generated this round, per family (a child's parent_id is its
        # family's id; counted here because a best_of output drops the children it ranks out).
        new_tokens: dict[str, int] = {}
        scheduled: dict[str, float] = {}
        for o in msg.outputs:
            fam = o.parent_id or o.request_id
            new_tokens[fam] = new_tokens.get(fam, 0) + len(o.new_token_ids)
            if o.scheduled_time is not None:
                scheduled[fam] = min(scheduled.get(fam, o.scheduled_time), o.scheduled_time)
        outs, to_abort = self._processor.process(msg.outputs)
        if to_abort and self.is_alive:
            self._send(AbortRequests(to_abort))  # stop strings: the core stops at once
        # vLLM's iteration tokens: generated tokens, plus the prompt of each request whose
        # first token came in this step (its prefill is counted when it completes).
        step_tokens = 0
        for out in outs:
            t = self._reqs.get(out.request_id)
            if t is None:
                continue
            new = new_tokens.get(out.request_id, 0)
            if new > 0:
                step_tokens += new + (t.num_prompt_tokens if t.num_tokens == 0 else 0)
            if t.scheduled_time is None:
                t.scheduled_time = scheduled.get(out.request_id)
            self._record(t, out, new, now)
            t.queue.put_nowait(out)
            if out.finished:
                del self._reqs[out.request_id]
        if step_tokens and self.metrics is not None:
            self.metrics.record_iteration(step_tokens)

    def _record(self, t: _Tracked, out: RequestOutput, new: int, now: float) -> None:
        """Metrics of one output of a request that made ``new`` tokens (all its children)."""
        m = self.metrics
        if m is not None and new > 0:
            if t.num_tokens == 0:
                t.first_token_time = now
                m.record_first_token(now - t.arrival, t.num_prompt_tokens)
                m.record_tokens(new, None)
            else:
                m.record_tokens(new, now - t.last_token_time)
        if new > 0:
            t.num_tokens, t.last_token_time = t.num_tokens + new, now
        if m is not None and out.finished:
            m.record_finished(now - t.arrival, out.outputs[0].finish_reason)
            m.record_request_tokens(t.num_prompt_tokens, t.num_tokens)
            m.record_request_params(t.n, t.max_tokens)
            if t.first_token_time is not None:
                # No scheduling time (a fork's family): no queue, prefill from arrival.
                start = t.scheduled_time if t.scheduled_time is not None else t.arrival
                start = min(max(start, t.arrival), t.first_token_time)
                m.record_phases(queue_s=start - t.arrival,
                                prefill_s=t.first_token_time - start,
                                decode_s=now - t.first_token_time, inference_s=now - start)

    # ------------------------------------------------------------------ requests
    async def generate(self, prompt: str | None, prompt_token_ids: list[int],
                       params: SamplingParams, *, request_id: str,
                       priority: int = 0, cache_salt: str | None = None,
                       mm_inputs: MultiModalInputs | None = None,
                       lora_request: LoRARequest | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative ``RequestOutput``s until the finished one.

        Outputs that pile up while the consumer is busy are coalesced (each is cumulative),
        so a slow stream reader gets fewer, larger deltas. Raises
        :class:`RequestRejectedError` when the core refuses the request and
        :class:`EngineDeadError` when the core dies. Leaving the iteration early (break,
        cancellation, ``aclose``) aborts the request in the core.
        """
        self.check_alive()
        if request_id in self._reqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        t = _Tracked(asyncio.Queue(), time.monotonic(), len(prompt_token_ids), n=params.n,
                     max_tokens=params.max_tokens)
        self._reqs[request_id] = t
        self._processor.add_request(request_id, prompt, prompt_token_ids, params)
        finished = False
        try:
            self._send(AddRequest(request_id, list(prompt_token_ids), params, priority,
                                  cache_salt, mm_inputs, lora_request))
            while not finished:
                items = [await t.queue.get()]
                while not t.queue.empty():
                    items.append(t.queue.get_nowait())
                for item in items:
                    if isinstance(item, BaseException):
                        finished = True  # nothing left to abort: the core dropped it
                        raise item
                out = items[-1]
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)

    def _record_abort(self, t: _Tracked) -> None:
        """Metrics of a request that ends unfinished: its prompt tokens count even when no
        token came back (a client that leaves during a long prefill)."""
        if self.metrics is not None:
            self.metrics.record_aborted(time.monotonic() - t.arrival,
                                        t.num_prompt_tokens if t.num_tokens == 0 else 0)

    def abort(self, request_id: str) -> None:
        """Forget a request here and tell the core to free its blocks (no-op if unknown)."""
        t = self._reqs.pop(request_id, None)
        if t is not None:
            self._record_abort(t)
        self._processor.abort(request_id)
        if self.is_alive and not self._closing:
            try:
                self._send(AbortRequests([request_id]))
            except EngineDeadError:
                pass

    async def utility(self, method: str, timeout: float = 10.0) -> Any:
        """Call ``method`` in the core (``ping``, ``pool_stats``) and return its result."""
        self.check_alive()
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            self._send(UtilityCall(call_id, method))
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError as e:
            raise EngineDeadError(f"the engine core did not answer {method!r} within "
                                  f"{timeout} s") from e
        finally:
            self._calls.pop(call_id, None)

    @property
    def num_in_flight(self) -> int:
        return len(self._reqs)
