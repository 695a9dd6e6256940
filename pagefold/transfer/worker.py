"""The transfer connector's worker side: the producer's outbox and server, the consumer's pulls.

Producer: an export op copies pool rows into the outbox (CPU tensors) at the start of the step
after the prefill finished, before anything of that step can overwrite them; from then on the
pool holds nothing for the transfer (it is whole). A server thread (a ZMQ ROUTER bound at
``kv_ip:kv_port``) answers pulls from the outbox; an entry leaves it once sent, when its
consumer releases it (a pull naming no key: it found the prefix in its own pool), or after
``keep_s`` when nobody pulled it. A pull that arrives before its export ran waits for it (up to
``keep_s``).

Consumer: the loads of a step are grouped per producer request into pulls, run by a pull thread
(a ZMQ DEALER per pull, ``pull_timeout_s`` to answer); every page of an answer is checked
(``wire.decode_pages``) and lands in the pool at the start of the first step after it arrived
(its destination pages belong to a request that computes nothing until its loads are reported).
A page that does not arrive, arrives late or fails a check is reported as failed: it never
reaches the pool and the request recomputes it. ``cancels`` drop the results of an aborted
request's pulls (its pages may be someone else's by then).

Mixed tensor parallelism (the producer's TP size is not the consumer's): a consumer rank pulls
every key from each producer rank whose shards overlap its own (``reshard.source_ranks``, over
all cache groups), in the producer's page geometry, and assembles its shard of each page
(``reshard.reshard_rows``); a key is landed only when every source answered it. Each pull
names how many consumer ranks pull that producer rank (``pullers``), so the export stays in
the producer's outbox until all of them pulled or released it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import torch
import zmq

from pagefold.core.kv_cache_spec import LayerSpec
from pagefold.core.kv_connector import ConnectorOutput, KVConnectorWorker, KVOps, PendingLoads
from pagefold.executor.cache_tensors import wide_rows
from pagefold.offload.page_file import PageGeometry
from pagefold.transfer.reshard import reshard_rows, source_ranks, spec_at
from pagefold.transfer.wire import decode_pages, decode_pull, encode_pages, encode_pull

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.02  # longest wait for a pull on a step with nothing else to compute
POLL_MS = 20  # the server's poll period (expiry and waiting pulls are checked this often)


def gather_rows(shared: list[torch.Tensor], layers: int, pages: list[int]) -> torch.Tensor:
    """Pool rows ``pages`` of the group's ``layers`` layers: (layers, pages, page_bytes) uint8
    on the CPU (a copy)."""
    idx = torch.tensor(pages, dtype=torch.int64, device=shared[0].device)
    rows = [wide_rows(shared[li]).index_select(0, idx).view(torch.uint8) for li in range(layers)]
    return torch.stack(rows).cpu()


def scatter_rows(shared: list[torch.Tensor], pages: list[int], rows: torch.Tensor) -> None:
    idx = torch.tensor(pages, dtype=torch.int64, device=shared[0].device)
    for li in range(rows.shape[0]):
        dst = wide_rows(shared[li])
        dst.index_copy_(0, idx, rows[li].to(shared[li].device).contiguous().view(dst.dtype))


class TransferWorker(KVConnectorWorker):
    def __init__(self, shared: list[torch.Tensor], group_layers: list[int], *, layout: str,
                 bind: tuple[str, int] | None, keep_s: float, pull_timeout_s: float,
                 rank: int = 0, tp_size: int = 1, specs: tuple[LayerSpec, ...] = (),
                 block_size: int = 0, pages_per_state: tuple[int, ...] = ()) -> None:
        """``tp_size``, ``specs`` (one per cache group), ``block_size`` and
        ``pages_per_state``: this engine's, for resharding pages from another TP size."""
        self.shared = shared
        self.tp_size, self.specs, self.block_size = tp_size, specs, block_size
        self.pages_per_state = pages_per_state
        self.page_bytes = shared[0].shape[1]
        self.group_layers = group_layers
        self.layout = layout
        self.rank = rank  # a consumer's rank r pulls from the producer's rank r (port + r)
        self.keep_s, self.pull_timeout_s = keep_s, pull_timeout_s
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        # producer request id -> [deadline, [(key name, group, rows)], pulls left (None: not
        # pulled yet; the first pull says how many)]
        self.outbox: dict[str, list] = {}
        self.sent = 0
        self.released = 0
        self.expired = 0
        self._stop = threading.Event()
        self._pulls: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._pending = PendingLoads()  # pulls not landed yet
        self.port: int | None = None
        self._threads = [threading.Thread(target=self._pull_loop, name="pagefold-kv-pull",
                                          daemon=True)]
        if bind is not None:
            sock = self._ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            host, port = bind
            try:
                if port:
                    sock.bind(f"tcp://{host}:{port}")
                    self.port = port
                else:
                    self.port = sock.bind_to_random_port(f"tcp://{host}")
            except zmq.ZMQError as e:
                sock.close(0)
                self._ctx.term()
                raise ValueError(f"kv_transfer_config: cannot serve pages at {host}:{port} "
                                 f"({e}); give another kv_ip / kv_port (0: any free port)"
                                 ) from None
            self._threads.append(threading.Thread(target=self._serve, args=(sock,),
                                                  name="pagefold-kv-serve", daemon=True))
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ producer
    def _serve(self, sock: zmq.Socket) -> None:
        waiting: list[tuple[bytes, dict, float]] = []  # pulls whose export has not run yet
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(POLL_MS):
                    ident, *frames = sock.recv_multipart()
                    try:
                        waiting.append((ident, decode_pull(frames), time.monotonic()))
                    except ValueError as e:
                        sock.send_multipart([ident, *encode_pages([], self.layout, str(e))])
                now = time.monotonic()
                still = []
                for ident, msg, t0 in waiting:
                    answer = self._answer(msg)
                    if answer is None and now - t0 < self.keep_s:
                        still.append((ident, msg, t0))
                        continue
                    if answer is None:
                        answer = encode_pages([], self.layout, f"no export for request "
                                              f"{msg.get('req')!r}")
                    sock.send_multipart([ident, *answer], copy=False)
                waiting = still
                self._expire(now)
        finally:
            sock.close(0)

    def _answer(self, msg: dict) -> list | None:
        """Frames answering a pull (the export leaves the outbox), or None: not exported yet."""
        if msg.get("layout") != self.layout:
            return encode_pages([], self.layout, f"layout {msg.get('layout')} is not this "
                                f"producer's {self.layout}")
        rid = str(msg.get("req"))
        with self._lock:
            entry = self.outbox.get(rid)
            if entry is None:
                return None
            left = entry[2] if entry[2] is not None else max(1, int(msg.get("pullers", 1)))
            entry[2] = left - 1
            # Counted before the entry leaves: a reader that sees the outbox empty (without
            # the lock) then also sees the count.
            if msg["keys"]:
                self.sent += 1
            else:  # a release: the consumer will not pull it
                self.released += 1
            if entry[2] <= 0:
                del self.outbox[rid]
        have = {name: (name, group, rows) for name, group, rows in entry[1]}
        pages = [have[k] for k in msg["keys"] if k in have]
        return encode_pages(pages, self.layout)

    def _expire(self, now: float) -> None:
        with self._lock:
            for rid in [r for r, entry in self.outbox.items() if entry[0] < now]:
                self.expired += 1  # before the entry leaves (see _answer)
                del self.outbox[rid]
                logger.warning("kv transfer: nobody pulled request %s's pages within %.0f s; "
                               "freed", rid, self.keep_s)

    # ------------------------------------------------------------------ consumer
    def _pull_loop(self) -> None:
        while True:
            job = self._pulls.get()
            if job is None:
                return
            req_id, remote, loads = job
            if loads is None:  # a release: the producer may free this export now
                self._release(remote)
                continue
            t0 = time.monotonic()
            try:
                got = self._pull(remote, loads)
            except Exception:  # noqa: BLE001 - a failed pull is recomputed, never fatal
                logger.exception("kv transfer: pull from %s:%s failed", remote.host,
                                 remote.port)
                got = {}
            self._done.put((req_id, loads, got, time.monotonic() - t0))

    def _sources(self, remote) -> dict[int, int]:
        """Producer rank -> how many consumer ranks pull it, for this rank's pulls of
        ``remote`` (the same TP size: its own rank, alone)."""
        if remote.tp_size == self.tp_size:
            return {self.rank: 1}

        def ranks(r: int) -> set[int]:
            return {s for spec in self.specs
                    for s in source_ranks(spec, remote.tp_size, self.tp_size, r)}
        mine = ranks(self.rank)
        return {s: sum(s in ranks(r) for r in range(self.tp_size)) for s in sorted(mine)}

    def _release(self, remote) -> None:
        layout = remote.layout or self.layout
        for src, pullers in self._sources(remote).items():
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.connect(f"tcp://{remote.host}:{remote.port + src}")
                sock.send_multipart(encode_pull(remote.remote_request_id, [], layout, pullers))
                sock.poll(1000)  # its answer (empty) says it arrived; a producer gone: nothing
            finally:
                sock.close(0)

    def _pull(self, remote, loads: list[tuple[str, int, list[int]]]) -> dict[str, torch.Tensor]:
        if remote.tp_size == self.tp_size:
            want = {name: PageGeometry(self.group_layers[g], len(pages), self.page_bytes)
                    for name, g, pages in loads}
            return self._pull_one(remote, self.rank, 1, want, self.layout)
        page_bytes, pps = remote.geometry
        want = {}
        for name, g, pages in loads:
            n = len(pages)
            if pps[g]:  # whole states: the producer's pages per state
                n = n // self.pages_per_state[g] * pps[g]
            want[name] = PageGeometry(self.group_layers[g], n, page_bytes)
        shards = {src: self._pull_one(remote, src, pullers, want, remote.layout)
                  for src, pullers in self._sources(remote).items()}
        got = {}
        for name, g, pages in loads:
            spec = self.specs[g]
            src_spec = spec_at(spec, remote.tp_size)
            need = source_ranks(spec, remote.tp_size, self.tp_size, self.rank)
            if any(name not in shards[s] for s in need):
                continue
            states = len(pages) // self.pages_per_state[g] if pps[g] else 1
            got[name] = torch.stack([
                reshard_rows(src_spec, spec, self.block_size,
                             {s: shards[s][name][li] for s in need}, self.page_bytes,
                             len(pages), remote.tp_size, self.tp_size, self.rank, states)
                for li in range(self.group_layers[g])])
        return got

    def _pull_one(self, remote, src: int, pullers: int, want: dict[str, PageGeometry],
                  layout: str) -> dict[str, torch.Tensor]:
        """The verified pages of one pull from producer rank ``src`` (empty: none came)."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://{remote.host}:{remote.port + src}")
            sock.send_multipart(encode_pull(remote.remote_request_id, list(want), layout,
                                            pullers))
            if not sock.poll(int(self.pull_timeout_s * 1000)):
                logger.warning("kv transfer: producer %s:%s did not answer for request %s in "
                               "%.1f s; recomputing the prefill", remote.host, remote.port,
                               remote.remote_request_id, self.pull_timeout_s)
                return {}
            frames = sock.recv_multipart(copy=False)
        finally:
            sock.close(0)
        got, error = decode_pages([f.buffer for f in frames], want, layout)
        if error is not None:
            logger.warning("kv transfer: producer %s:%s: %s; recomputing the prefill",
                           remote.host, remote.port, error)
        elif len(got) < len(want):
            logger.warning("kv transfer: %d of %d pages from %s:%s missing or corrupt; "
                           "recomputing them", len(want) - len(got), len(want), remote.host,
                           remote.port)
        return got

    def _land(self, item: tuple, out: ConnectorOutput) -> None:
        req_id, loads, got, seconds = item
        out.pulls += 1
        out.pull_seconds += seconds
        if self._pending.wanted(req_id):
            for name, _, pages in loads:
                rows = got.get(name)
                if rows is None:
                    self._pending.fail(req_id, name)
                    continue
                scatter_rows(self.shared, pages, rows)
                out.count_load("remote", rows)
        self._pending.landed(req_id, out)

    # ------------------------------------------------------------------ a step's ops
    @torch.inference_mode()
    def run(self, ops: KVOps) -> ConnectorOutput:
        out = ConnectorOutput()
        for req_id in ops.cancels:
            self._pending.cancel(req_id)
        exports: dict[str, list] = {}
        for ex in ops.exports:
            rows = gather_rows(self.shared, self.group_layers[ex.group], ex.pages)
            exports.setdefault(ex.req_id, []).append((ex.key, ex.group, rows))
            out.bytes_saved += rows.numel()
        if exports:
            deadline = time.monotonic() + self.keep_s
            with self._lock:
                for rid, pages in exports.items():
                    self.outbox[rid] = [deadline, pages, None]
        by_name = {(ld.req_id, ld.key): ld for ld in ops.loads}
        for src in ops.remotes:
            loads = [(n, by_name[(src.req_id, n)].group, by_name[(src.req_id, n)].pages)
                     for n in src.keys]
            self._pending.start(src.req_id)
            self._pulls.put((src.req_id, src, loads))
        for rel in ops.releases:
            self._pulls.put((rel.req_id, rel, None))
        self._collect(out, wait=ops.idle and bool(self._pending))
        return out

    def _collect(self, out: ConnectorOutput, wait: bool) -> None:
        try:
            if wait:
                self._land(self._done.get(timeout=IDLE_WAIT_S), out)
            while True:
                self._land(self._done.get_nowait(), out)
        except queue.Empty:
            pass

    def close(self) -> None:
        self._stop.set()
        self._pulls.put(None)
        for t in self._threads:
            t.join(timeout=5)
        self._ctx.term()
