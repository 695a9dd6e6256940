"""The offload connector's worker side: the host tier's tensors and the disk tier's files.

One store per runner (per tensor-parallel rank: each keeps its shard of every page). It runs
a step's ops (``core.kv_connector``) synchronously, before the step's page copies, swaps and
forward: drops, saves (pool rows -> host slots and / or a page file), loads (host slots or a
verified page file -> pool rows). A disk page that is missing or fails any check of
``page_file.read_page_file`` is deleted, reported as failed and never copied into the pool.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from pagefold.core.kv_connector import ConnectorOutput, KVConnectorWorker, KVOps
from pagefold.executor.cache_tensors import wide_rows
from pagefold.offload.page_file import (
    PageFileError,
    PageGeometry,
    page_path,
    read_page_file,
    write_page_file,
)

logger = logging.getLogger(__name__)


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
        if disk_dir is not None:
            disk_dir.mkdir(parents=True, exist_ok=True)

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

    @torch.inference_mode()
    def run(self, ops: KVOps) -> ConnectorOutput:
        out = ConnectorOutput()
        for name in ops.drops:
            page_path(self.disk_dir, name).unlink(missing_ok=True)
        for s in ops.saves:
            rows = self._gather(s.group, s.pages)
            if s.host_slots:
                slots = torch.tensor(s.host_slots, dtype=torch.int64)
                for li in range(rows.shape[0]):
                    self.host[li].index_copy_(0, slots, rows[li])
            if s.to_disk:
                try:
                    write_page_file(page_path(self.disk_dir, s.key), key=s.key, group=s.group,
                                    layout=self.layout, geom=self._geom(s.group, len(s.pages)),
                                    saved_tokens=s.saved_tokens,
                                    payload=memoryview(rows.numpy()).cast("B"))
                except OSError as e:
                    logger.warning("disk tier: cannot write %s (%s); not offloading it",
                                   s.key, e.strerror or e)
                    out.store_failed.append(s.key)
            out.bytes_saved += rows.numel()
        for ld in ops.loads:
            if ld.req_id not in out.finished:
                out.finished.append(ld.req_id)
            if ld.host_slots:
                slots = torch.tensor(ld.host_slots, dtype=torch.int64)
                rows = torch.stack([self.host[li].index_select(0, slots)
                                    for li in range(self.group_layers[ld.group])])
                tier = "host"
            else:
                geom = self._geom(ld.group, len(ld.pages))
                path = page_path(self.disk_dir, ld.key)
                try:
                    payload = read_page_file(path, key=ld.key, layout=self.layout, geom=geom)
                except PageFileError as e:
                    logger.warning("disk tier: %s; recomputing instead", e)
                    path.unlink(missing_ok=True)
                    out.failed.setdefault(ld.req_id, []).append(ld.key)
                    continue
                rows = torch.frombuffer(payload, dtype=torch.uint8).view(
                    geom.layers, geom.pages, geom.page_bytes)
                os.utime(path)  # LRU order survives a restart
                tier = "disk"
            self._scatter(ld.group, ld.pages, rows)
            out.loaded_from[tier] = out.loaded_from.get(tier, 0) + 1
            out.bytes_loaded += rows.numel()
        return out
