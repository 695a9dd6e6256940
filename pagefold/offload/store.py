"""The offload connector's worker side: the host tier's tensors and the disk tier's files.

One store per runner (per tensor-parallel rank: each keeps its shard of every page). A step's
ops (``core.kv_connector``) run before that step's page copies, swaps and forward:

* drops and disk writes go to this store's I/O thread, in order (a FIFO: a write, a later
  read and a later drop of one key meet in the order they were asked for);
* a save reads its pool rows now (the step may overwrite them) into a CPU tensor: the host
  slots get it now, the disk write happens in the I/O thread;
* a load from the host tier lands now; a load from disk is read and verified in the I/O thread
  while the engine goes on computing other requests, and lands at the start of the first step
  after it finished (its destination pages belong to a request that computes nothing until its
  loads are reported, so nothing reads or writes them meanwhile).

A request is reported ``finished`` once its last load landed; a disk page that is missing or
fails any check of ``page_file.read_page_file`` is deleted, reported as failed and never
copied into the pool. ``cancels`` (an aborted loading request) drop its loads' results: its
pages may belong to another request by the time they arrive. On an idle step (nothing else to
compute) ``run`` waits briefly for a read rather than spinning.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from pathlib import Path

import torch

from pagefold.core.kv_connector import ConnectorOutput, KVConnectorWorker, KVOps, PendingLoads
from pagefold.executor.cache_tensors import wide_rows
from pagefold.offload.page_file import (
    PageFileError,
    PageGeometry,
    page_path,
    read_page_file,
    write_page_file,
)

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.02  # longest wait for a disk read on a step with nothing else to compute


class OffloadStore(KVConnectorWorker):
    def __init__(self, shared: list[torch.Tensor], group_layers: list[int], host_slots: int,
                 *, disk_dir: Path | None = None, layout: str = "") -> None:
        self.shared = shared  # the pool's shared byte tensors (num_blocks, page_bytes)
        self.page_bytes = shared[0].shape[1]
        self.group_layers = group_layers
        pin = shared[0].device.type == "cuda"
        n = max(group_layers) if host_slots else 0
        self.host = [torch.zeros((host_slots, self.page_bytes), dtype=torch.uint8,
                                 pin_memory=pin) for _ in range(n)]
        self.disk_dir = disk_dir
        self.layout = layout
        self._jobs: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._pending = PendingLoads()  # disk reads not landed yet
        self._thread: threading.Thread | None = None
        if disk_dir is not None:
            disk_dir.mkdir(parents=True, exist_ok=True)
            self._thread = threading.Thread(target=self._io_loop, name="pagefold-offload-io",
                                            daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ pool rows
    def _geom(self, group: int, pages: int) -> PageGeometry:
        return PageGeometry(self.group_layers[group], pages, self.page_bytes)

    def _gather(self, group: int, pages: list[int]) -> torch.Tensor:
        """Pool rows ``pages`` of every layer of ``group``: (layers, pages, page_bytes) uint8
        on the CPU."""
        idx = torch.tensor(pages, dtype=torch.int64, device=self.shared[0].device)
        rows = [wide_rows(self.shared[li]).index_select(0, idx).view(torch.uint8)
                for li in range(self.group_layers[group])]
        return torch.stack(rows).cpu()

    def _scatter(self, group: int, pages: list[int], rows: torch.Tensor) -> None:
        idx = torch.tensor(pages, dtype=torch.int64, device=self.shared[0].device)
        for li in range(self.group_layers[group]):
            dst = wide_rows(self.shared[li])
            src = rows[li].to(self.shared[li].device).contiguous().view(dst.dtype)
            dst.index_copy_(0, idx, src)

    # ------------------------------------------------------------------ the I/O thread
    def _io_loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                getattr(self, f"_do_{job[0]}")(*job[1:])
            except Exception:  # noqa: BLE001 - a failed job is logged, never fatal
                logger.exception("offload I/O job %s failed", job[0] if job else job)
            finally:
                self._jobs.task_done()

    def _do_drop(self, name: str) -> None:
        page_path(self.disk_dir, name).unlink(missing_ok=True)

    def _do_write(self, name: str, group: int, rows: torch.Tensor, saved_tokens: int) -> None:
        try:
            write_page_file(page_path(self.disk_dir, name), key=name, group=group,
                            layout=self.layout, geom=self._geom(group, rows.shape[1]),
                            saved_tokens=saved_tokens,
                            payload=memoryview(rows.numpy()).cast("B"))
        except OSError as e:
            logger.warning("disk tier: cannot write %s (%s); not offloading it", name,
                           e.strerror or e)
            self._done.put(("write_failed", name))

    def _do_read(self, req_id: str, name: str, group: int, pages: list[int]) -> None:
        geom = self._geom(group, len(pages))
        path = page_path(self.disk_dir, name)
        try:
            payload = read_page_file(path, key=name, layout=self.layout, geom=geom)
        except PageFileError as e:
            logger.warning("disk tier: %s; recomputing instead", e)
            path.unlink(missing_ok=True)
            self._done.put(("read", req_id, name, group, pages, None))
            return
        with contextlib.suppress(OSError):
            os.utime(path)  # LRU order survives a restart
        rows = torch.frombuffer(payload, dtype=torch.uint8).view(
            geom.layers, geom.pages, geom.page_bytes)
        self._done.put(("read", req_id, name, group, pages, rows))

    def drain(self) -> None:
        """Wait until every queued disk write, drop and read has run."""
        if self._thread is not None:
            self._jobs.join()

    def close(self) -> None:
        """Finish the queued I/O and stop the thread (pending writes reach the disk)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    # ------------------------------------------------------------------ a step's ops
    def _land(self, item: tuple, out: ConnectorOutput) -> None:
        if item[0] == "write_failed":
            out.store_failed.append(item[1])
            return
        _, req_id, name, group, pages, rows = item
        if self._pending.wanted(req_id):
            if rows is None:
                self._pending.fail(req_id, name)
            else:
                self._scatter(group, pages, rows)
                out.count_load("disk", rows)
        self._pending.landed(req_id, out)

    @torch.inference_mode()
    def run(self, ops: KVOps) -> ConnectorOutput:
        out = ConnectorOutput()
        for req_id in ops.cancels:
            self._pending.cancel(req_id)
        for name in ops.drops:
            self._jobs.put(("drop", name))
        for s in ops.saves:
            rows = self._gather(s.group, s.pages)
            if s.host_slots:
                slots = torch.tensor(s.host_slots, dtype=torch.int64)
                for li in range(rows.shape[0]):
                    self.host[li].index_copy_(0, slots, rows[li])
            if s.to_disk:
                self._jobs.put(("write", s.key, s.group, rows, s.saved_tokens))
            out.bytes_saved += rows.numel()
        started: list[str] = []
        for ld in ops.loads:
            if ld.req_id not in started:
                started.append(ld.req_id)
            if ld.host_slots:
                slots = torch.tensor(ld.host_slots, dtype=torch.int64)
                rows = torch.stack([self.host[li].index_select(0, slots)
                                    for li in range(self.group_layers[ld.group])])
                self._scatter(ld.group, ld.pages, rows)
                out.count_load("host", rows)
            else:
                self._pending.start(ld.req_id)
                self._jobs.put(("read", ld.req_id, ld.key, ld.group, ld.pages))
        for req_id in started:  # host-only requests are done now
            if req_id not in self._pending:
                self._pending.report(req_id, out)
        if ops.drain:
            self.drain()
        self._collect(out, wait=ops.idle and bool(self._pending))
        return out

    def _collect(self, out: ConnectorOutput, wait: bool) -> None:
        """Land every finished disk read (waiting up to ``IDLE_WAIT_S`` for the first one
        when ``wait``)."""
        try:
            if wait:
                self._land(self._done.get(timeout=IDLE_WAIT_S), out)
            while True:
                self._land(self._done.get_nowait(), out)
        except queue.Empty:
            pass
