"""The EngineCore in its own process: a lean busy loop between two ZMQ sockets.

The API process (``pagefold.engine.client``) binds two ipc sockets and starts this module as
``python -m pagefold.engine.core_proc``; the core connects to both:

* ``input`` (API PUSH -> core PULL): msgpack :data:`InputMessage` -- add, abort, utility
  calls, shutdown;
* ``output`` (core PUSH -> API PULL): msgpack :data:`OutputMessage` -- first a :class:`Ready`
  handshake (or a :class:`Fatal` when the engine cannot be built), then :class:`Outputs` after
  every loop iteration that produced something, carrying the scheduler/pool
  :class:`CoreStats` every ``STATS_INTERVAL`` and whenever the core turns idle.

Invariants of the loop:

* every message that arrived is handled before the next ``step()``, so an abort frees the
  request's blocks before the step after it arrives;
* an ``add`` that the core rejects (``ValueError``) queues nothing and comes back as a
  :class:`RequestError` for that request id, never as a crash;
* an ``add`` whose structured-output grammar is not compiled yet waits in a one-thread
  compile pool (xgrammar releases the GIL while it compiles) and enters the scheduler at the
  first loop iteration after its grammar is cached: a slow schema never stalls the steps of
  the requests already running; an abort of a waiting request drops it. The grammar
  compiler itself (tokenizer, vocabulary tables) is built in that thread right after the
  handshake;
* any other exception is fatal: it is reported as :class:`Fatal` and the process exits 1;
* the process exits when its parent dies (``PR_SET_PDEATHSIG`` sends SIGTERM on Linux, plus
  a ``getppid`` check at least once a second) and on SIGTERM (after the current step);
  SIGINT is ignored (a Ctrl-C reaches the whole
  process group; the API process decides how to shut down and tells the core).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec
import zmq

from pagefold.checkpoint import text_config
from pagefold.config import EngineConfig
from pagefold.engine.core import EngineCore, EngineCoreOutput
from pagefold.lora.request import LoRARequest
from pagefold.multimodal.inputs import MultiModalInputs
from pagefold.sampling_params import SamplingParams

logger = logging.getLogger("pagefold.core_proc")

# Seconds between parent-liveness checks while busy (an idle core checks after every poll).
PARENT_CHECK_INTERVAL = 1.0
# How long an idle core waits for input before re-checking SIGTERM and its parent.
IDLE_POLL_MS = 250
# Scheduler/pool stats ride on outputs at most this often while busy (seconds).
STATS_INTERVAL = 0.1
# How long an otherwise idle core waits for input while a grammar compiles (ms).
COMPILE_POLL_MS = 5


# ---------------------------------------------------------------------- API -> core messages
class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    mm_inputs: MultiModalInputs | None = None  # the prompt's images (None: text only)
    lora_request: LoRARequest | None = None


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="utility"):
    """A call answered in the next :class:`Outputs` (see :func:`_utility` for ``method``)."""

    call_id: int
    method: str


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


InputMessage = AddRequest | AbortRequests | UtilityCall | Shutdown


# ---------------------------------------------------------------------- core -> API messages
class GroupUsage(msgspec.Struct):
    """Blocks held by the requests of one cache group (a group is one kind of layer)."""

    kind: str
    num_layers: int
    num_blocks: int


class CoreStats(msgspec.Struct):
    num_running: int
    num_waiting: int
    num_preemptions: int  # cumulative since start
    num_free_blocks: int
    num_usable_blocks: int
    kv_usage: float  # 1 - free/usable, in [0, 1]
    groups: list[GroupUsage]
    num_steps: int  # cumulative model steps
    prefix_queries: int = 0  # cumulative prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # cumulative tokens of those served from the cache
    prefix_local_hits: int = 0  # of those, from the pool itself (not a KV connector)
    external_prefix_queries: int = 0  # prompt tokens looked up while a KV connector is on
    prompt_tokens_computed: int = 0  # cumulative prompt tokens the forwards computed
    prefix_requests: int = 0  # cumulative admissions looked up in the prefix cache
    prefix_requests_hit: int = 0  # of those, admissions with at least one cached block
    preemptions_by_kind: dict[str, int] = {}  # cumulative, "swap" / "recompute"
    swaps_out: int = 0  # cumulative requests swapped out to the host pool
    swaps_in: int = 0  # cumulative requests swapped back in
    swap_bytes_out: int = 0  # cumulative bytes copied device -> host
    swap_bytes_in: int = 0  # cumulative bytes copied host -> device
    recomputed_tokens: int = 0  # cumulative computed tokens dropped by recompute preemptions
    credited_tokens: int = 0  # of those, expected back from the prefix cache / checkpoints
    num_forks: int = 0  # cumulative forked requests (parallel-sampling children, beams)
    num_checkpoints: int = 0  # state checkpoints cached now
    checkpoint_bytes: int = 0  # pool bytes those checkpoints occupy now
    spec_num_drafts: int = 0  # cumulative verify rounds with drafts (speculative decoding)
    spec_num_draft_tokens: int = 0  # cumulative drafted tokens
    spec_num_accepted_tokens: int = 0  # cumulative accepted drafted tokens
    num_aborted: int = 0  # cumulative requests the core aborted (disconnects, stop strings)
    # Offload tiers (cumulative; offload/index.py OffloadStats): pages saved to / loaded from
    # each tier, prompt tokens served from the tiers, bad pages detected, refused writes.
    offload_saves_host: int = 0
    offload_saves_disk: int = 0
    offload_loads_host: int = 0
    offload_loads_disk: int = 0
    offload_tokens_loaded: int = 0
    offload_load_failures: int = 0
    offload_store_failures: int = 0
    offload_checkpoints_staged: int = 0  # checkpoints saved through staging pages
    # Prefill/decode disaggregation (cumulative; transfer/index.py TransferStats): prompt tokens
    # and payload bytes pulled from producers, pages that failed (recomputed), requests whose
    # params were refused, requests exported to consumers.
    transfer_tokens_loaded: int = 0
    transfer_bytes_loaded: int = 0
    transfer_load_failures: int = 0
    transfer_refused: int = 0
    transfer_exports: int = 0
    transfer_exports_held: int = 0  # exported prefills waiting for their consumer now
    transfer_pulls: int = 0  # pulls that landed (consumer)
    transfer_pull_seconds: float = 0.0  # their wall time, request to answer


class RequestError(msgspec.Struct):
    request_id: str
    message: str


class UtilityResult(msgspec.Struct):
    call_id: int
    result: Any = None
    error: str | None = None


class Ready(msgspec.Struct, tag="ready"):
    pid: int
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    block_size: int
    num_usable_blocks: int
    max_num_batched_tokens: int
    groups: list[str]


class Outputs(msgspec.Struct, tag="outputs"):
    """``stats`` is attached at most every ``STATS_INTERVAL`` while busy (counting held blocks
    costs a pass over them), and always when the core turns idle or handled input.

    ``outputs`` are the core's own records, every field included: a parallel-sampling child
    arrives as ``rid#i`` with ``parent_id`` (the family id) and ``index``; the API side's
    OutputProcessor folds the children back into the family's output."""

    outputs: list[EngineCoreOutput]
    stats: CoreStats | None = None
    errors: list[RequestError] = []
    utility: list[UtilityResult] = []


class Fatal(msgspec.Struct, tag="fatal"):
    message: str


OutputMessage = Ready | Outputs | Fatal


# ---------------------------------------------------------------------- stats
def core_stats(core, num_steps: int = 0) -> CoreStats:
    """Scheduler and pool counters; per-group block counts exclude the null block.

    Checkpoint bytes are ``blocks * layers_per_group * page_bytes`` (a pool block spans one
    page in every layer of its group)."""
    kv, s = core.kv, core.scheduler
    pstats = getattr(kv, "stats", None)  # PrefixCacheStats (absent: no prefix cache)
    swap, plog = kv.swap_stats, kv.preempt_log
    num_ck, ck_blocks = kv.pool.checkpoint_stats()
    cfg = core.kv_config
    groups = []
    for m in kv.managers:
        held = sum(1 for blocks in m.req_blocks.values() for b in blocks
                   if b is not kv.pool.null_block)
        groups.append(GroupUsage(type(m.group.spec).__name__, len(m.group.layer_names), held))
    return CoreStats(
        num_running=s.num_running, num_waiting=s.num_waiting,
        num_preemptions=s.num_preemptions, num_free_blocks=kv.pool.num_free,
        num_usable_blocks=kv.pool.num_usable, kv_usage=kv.usage, groups=groups,
        num_steps=num_steps, prefix_queries=int(getattr(pstats, "queries", 0)),
        prefix_hits=int(getattr(pstats, "hits", 0)),
        prefix_local_hits=int(getattr(pstats, "local_hits", 0)),
        external_prefix_queries=(int(getattr(pstats, "queries", 0))
                                 if getattr(kv, "connector", None) is not None else 0),
        prompt_tokens_computed=s.prompt_tokens_computed,
        prefix_requests=int(getattr(pstats, "requests", 0)),
        prefix_requests_hit=int(getattr(pstats, "requests_hit", 0)),
        preemptions_by_kind=dict(s.preemptions_by_kind), swaps_out=swap.swaps_out,
        swaps_in=swap.swaps_in, swap_bytes_out=swap.bytes_out, swap_bytes_in=swap.bytes_in,
        recomputed_tokens=plog.recomputed_tokens, credited_tokens=plog.credited_tokens,
        num_forks=s.num_forks, num_checkpoints=num_ck,
        checkpoint_bytes=ck_blocks * cfg.layers_per_group * cfg.page_bytes,
        num_aborted=s.num_aborted, **_spec_stats(core), **_offload_stats(core),
        **_transfer_stats(core))


def _transfer_stats(core) -> dict[str, int]:
    index = getattr(core, "transfer", None)
    if index is None:
        return {}
    st = index.stats
    return {"transfer_tokens_loaded": st.tokens_loaded, "transfer_bytes_loaded": st.bytes_loaded,
            "transfer_load_failures": st.load_failures, "transfer_refused": st.refused,
            "transfer_exports": st.exports, "transfer_pulls": st.pulls,
            "transfer_pull_seconds": st.pull_seconds,
            # The outbox of this process's runner (tensor parallelism: the ranks hold theirs).
            "transfer_exports_held": len(getattr(getattr(core.runner, "connector", None),
                                                 "outbox", ()))}


def _offload_stats(core) -> dict[str, int]:
    index = getattr(core, "offload", None)
    if index is None:
        return {}
    st = index.stats
    return {"offload_saves_host": st.saves_host, "offload_saves_disk": st.saves_disk,
            "offload_loads_host": st.loads_host, "offload_loads_disk": st.loads_disk,
            "offload_tokens_loaded": st.tokens_loaded,
            "offload_load_failures": st.load_failures,
            "offload_store_failures": st.store_failures,
            "offload_checkpoints_staged": (core.kv.staging.staged
                                           if core.kv.staging is not None else 0)}


def _spec_stats(core) -> dict[str, int]:
    spec = getattr(core, "spec", None)
    if spec is None:
        return {}
    m = spec.metrics
    return {"spec_num_drafts": m.num_drafts, "spec_num_draft_tokens": m.num_draft_tokens,
            "spec_num_accepted_tokens": m.num_accepted_tokens}


def _utility(core, method: str, num_steps: int) -> Any:
    """``pool_stats``: pool and queue counters, the preemption / swap / fork / checkpoint /
    prefix-cache counters of :class:`CoreStats`, ``prefix_hit_rate`` (cached / looked-up
    prompt tokens) and ``whole`` (no block held, all free, host pool empty);
    ``ping``: ``"pong"``."""
    if method == "ping":
        return "pong"
    if method == "pool_stats":
        st = core_stats(core, num_steps)
        try:
            core.kv.check_whole()
            whole = True
        except AssertionError:
            whole = False
        out = msgspec.structs.asdict(st)
        out["groups"] = [msgspec.structs.asdict(g) for g in st.groups]
        out["prefix_hit_rate"] = st.prefix_hits / st.prefix_queries if st.prefix_queries else 0.0
        out["whole"] = whole
        return out
    raise ValueError(f"unknown utility method {method!r}; known: ping, pool_stats")


# ---------------------------------------------------------------------- process plumbing
def _set_parent_death_signal() -> None:
    """Ask Linux to SIGTERM us when the parent dies (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        logger.debug("prctl(PR_SET_PDEATHSIG) unavailable; relying on getppid checks")


_stop_requested = False


def _on_sigterm(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
    # Only a flag: raising from a handler can land inside zmq or interpreter teardown. The
    # loop sees it within one step (or one idle poll).
    global _stop_requested
    _stop_requested = True


class _CoreLoop:
    """The busy loop. Owns the sockets and the EngineCore; see the module docstring."""

    def __init__(self, core, in_sock: zmq.Socket, out_sock: zmq.Socket, parent_pid: int) -> None:
        self.core = core
        self.in_sock = in_sock
        self.out_sock = out_sock
        self.parent_pid = parent_pid
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(InputMessage)
        self.num_steps = 0
        self._last_parent_check = time.monotonic()
        self._last_stats = 0.0
        self._compile_pool: ThreadPoolExecutor | None = None
        self._pending: list[tuple[Future, AddRequest]] = []  # grammars compiling, in order

    def parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid

    def _decode(self, frame: bytes, errors: list[RequestError]) -> InputMessage | None:
        try:
            return self.decoder.decode(frame)
        except msgspec.DecodeError as e:
            # A bad add still has a request id: answer it instead of dropping it silently.
            try:
                raw = msgspec.msgpack.decode(frame)
            except msgspec.DecodeError:
                raw = None
            rid = raw.get("request_id") if isinstance(raw, dict) else None
            if isinstance(rid, str):
                errors.append(RequestError(rid, str(e)))
            else:
                logger.error("dropping undecodable message: %s", e)
            return None

    def handle_inputs(self, block_ms: int) -> tuple[bool, bool, list, list]:
        """Drain the input socket. Returns (anything handled, shutdown asked, errors, utility)."""
        errors: list[RequestError] = []
        utility: list[UtilityResult] = []
        handled = stop = False
        if not self.in_sock.poll(block_ms):
            return handled, stop, errors, utility
        while True:
            try:
                frame = self.in_sock.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            handled = True
            msg = self._decode(frame, errors)
            if isinstance(msg, AddRequest):
                self._add(msg, errors)
            elif isinstance(msg, AbortRequests):
                gone = set(msg.request_ids)
                self._pending = [(f, m) for f, m in self._pending if m.request_id not in gone]
                self.core.abort(msg.request_ids)
            elif isinstance(msg, UtilityCall):
                try:
                    result = _utility(self.core, msg.method, self.num_steps)
                    utility.append(UtilityResult(msg.call_id, result))
                except ValueError as e:
                    utility.append(UtilityResult(msg.call_id, error=str(e)))
            elif isinstance(msg, Shutdown):
                stop = True
        return handled, stop, errors, utility

    # ------------------------------------------------------------------ adding requests
    def _add_now(self, msg: AddRequest, errors: list[RequestError]) -> None:
        try:
            self.core.add_request(msg.request_id, msg.prompt_token_ids, msg.params,
                                  priority=msg.priority, cache_salt=msg.cache_salt,
                                  mm_inputs=msg.mm_inputs, lora_request=msg.lora_request)
        except ValueError as e:
            errors.append(RequestError(msg.request_id, str(e)))

    def _add(self, msg: AddRequest, errors: list[RequestError]) -> None:
        """Queue ``msg`` now, or once its grammar is compiled (off this thread)."""
        structured = getattr(self.core, "structured", None)
        so = msg.params.structured_outputs
        if so is None or structured is None or structured.is_compiled(so):
            self._add_now(msg, errors)
            return
        self._pending.append((self._pool().submit(structured.check, msg.params), msg))

    def _pool(self) -> ThreadPoolExecutor:
        if self._compile_pool is None:
            self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="pagefold-grammar")
        return self._compile_pool

    def warm_structured(self) -> None:
        """Build the grammar compiler now, in the compile thread, while the core is idle
        after start-up: loading the tokenizer and xgrammar's vocabulary tables is ~1 s of
        mostly Python work (it holds the GIL), which would otherwise stall the steps of the
        requests running when the first structured request arrives."""
        structured = getattr(self.core, "structured", None)
        if structured is None:
            return

        def build() -> None:
            structured.compiler.json_safe_mask()

        def report(fut: Future) -> None:
            if fut.exception() is not None:  # the first structured request raises it again
                logger.warning("structured output unavailable: %s", fut.exception())

        self._pool().submit(build).add_done_callback(report)

    def admit_compiled(self, errors: list[RequestError]) -> bool:
        """Queue the waiting requests whose grammar is ready (a compile error is that
        request's :class:`RequestError`); True when any was handled."""
        if not self._pending or not any(f.done() for f, _ in self._pending):
            return False
        still = []
        for fut, msg in self._pending:
            if not fut.done():
                still.append((fut, msg))
                continue
            exc = fut.exception()
            if exc is None:
                self._add_now(msg, errors)
            elif isinstance(exc, ValueError):
                errors.append(RequestError(msg.request_id, str(exc)))
            else:
                raise exc
        self._pending = still
        return True

    def close(self) -> None:
        if self._compile_pool is not None:
            self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self.core.save_prefixes()  # offload tiers: the pool's prefixes outlive the process

    def send(self, outputs: list[EngineCoreOutput], errors, utility, *,
             with_stats: bool = True) -> None:
        now = time.monotonic()
        stats = None
        if with_stats or now - self._last_stats >= STATS_INTERVAL:
            stats = core_stats(self.core, self.num_steps)
            self._last_stats = now
        self.out_sock.send(self.encoder.encode(Outputs(outputs, stats, errors, utility)),
                           copy=False)

    def run(self) -> None:
        while not _stop_requested:
            busy = self.core.has_unfinished()
            wait = 0 if busy else COMPILE_POLL_MS if self._pending else IDLE_POLL_MS
            handled, stop, errors, utility = self.handle_inputs(wait)
            if stop:
                logger.info("shutdown requested")
                return
            handled = self.admit_compiled(errors) or handled
            outputs: list[EngineCoreOutput] = []
            stepped = False
            if self.core.has_unfinished():
                outputs = self.core.step()
                self.num_steps += 1
                stepped = True
            now = time.monotonic()
            idle_now = stepped and not self.core.has_unfinished()
            if (outputs or errors or utility or handled or idle_now
                    or (stepped and now - self._last_stats >= STATS_INTERVAL)):
                self.send(outputs, errors, utility, with_stats=handled or idle_now)
            if now - self._last_parent_check >= PARENT_CHECK_INTERVAL or not busy:
                self._last_parent_check = now
                if not self.parent_alive():
                    logger.warning("parent process %d is gone; exiting", self.parent_pid)
                    return
        logger.info("SIGTERM: exiting")


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str,
                    parent_pid: int) -> int:
    """Build the EngineCore, handshake, run the loop. Returns the process exit code."""
    # SIGTERM keeps its default (die at once) while the engine loads; the loop installs the
    # graceful handler.
    _set_parent_death_signal()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.getppid() != parent_pid:
        return 1  # the parent died before prctl took effect
    ctx = zmq.Context()
    in_sock = ctx.socket(zmq.PULL)
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.SNDHWM, 0)
    # Let a last Fatal message reach the API process after we decide to exit.
    out_sock.setsockopt(zmq.LINGER, 2000)
    in_sock.setsockopt(zmq.LINGER, 0)
    in_sock.connect(input_addr)
    out_sock.connect(output_addr)
    encoder = msgspec.msgpack.Encoder()
    code = 0
    try:
        try:
            core = EngineCore(config)
        except Exception as e:  # noqa: BLE001 - reported to the API process, then exit
            msg = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            logger.error("cannot build the engine: %s", msg)
            out_sock.send(encoder.encode(Fatal(msg)))
            return 1
        kv = core.kv
        out_sock.send(encoder.encode(Ready(
            pid=os.getpid(), max_model_len=core.max_model_len,
            vocab_size=int(text_config(core.hf_config).vocab_size),
            eos_token_id=core.eos_token_id, block_size=kv.block_size,
            num_usable_blocks=kv.pool.num_usable,
            max_num_batched_tokens=core.max_num_batched_tokens,
            groups=[type(m.group.spec).__name__ for m in kv.managers])))
        loop = _CoreLoop(core, in_sock, out_sock, parent_pid)
        loop.warm_structured()
        signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            loop.run()
            loop.close()
        except Exception as e:  # noqa: BLE001 - a crash is reported, never silent
            tb = traceback.format_exc()
            logger.error("engine core failed:\n%s", tb)
            out_sock.send(encoder.encode(Fatal(f"{type(e).__name__}: {e}")))
            code = 1
    finally:
        in_sock.close()
        out_sock.close()
        ctx.term()
    return code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="pagefold EngineCore process (started by the server)")
    p.add_argument("--input", required=True, help="ZMQ address to pull requests from")
    p.add_argument("--output", required=True, help="ZMQ address to push outputs to")
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--config", required=True, help="EngineConfig fields as JSON")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(levelname)s EngineCore[{os.getpid()}] %(name)s: %(message)s")
    config = EngineConfig(**json.loads(args.config))
    return run_engine_core(config, args.input, args.output, args.parent_pid)


if __name__ == "__main__":
    code = main()
    # Everything is sent and closed by now (the output socket lingers until delivered):
    # skip the interpreter's slow teardown of torch & co (seconds), which would stretch a
    # graceful shutdown past its deadline.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
