"""The offload connector's scheduler side: what the host and disk tiers hold, and the ops.

Invariants:

* The index is the authority: a worker writes a host slot or a page file only when a step's
  ops say so, so every tensor-parallel rank holds the same keys in the same slots.
* The tiers are inclusive: a saved page goes to the host tier (when it has one) *and* the disk
  tier (when it has one); the host tier is a fast copy of the newest pages, the disk tier the
  durable one a restarted engine reads (``scan`` rebuilds its index, oldest file first).
* Each tier is LRU (a load or a save refreshes a key) and capped: host by slots
  (``kv_offloading_size`` / (layers x page bytes)), disk by payload bytes.
* A key a hit is about to load is pinned (``pin``, before the hit allocates; ``record_load``)
  until the step being built is taken: no save or drop of that step reuses its slots or
  deletes its file (ops run drops, saves, loads in that order; disk I/O keeps that order in
  the store's FIFO).
* A key whose load failed (missing, truncated, corrupt) or whose write failed (disk full) is
  forgotten once the worker reports it: the request recomputes, later requests stop asking
  for it. (A disk write is reported in a later step: a load asked for before then fails the
  same way and is recomputed.) The disk cap counts payload bytes for pages this engine
  wrote and file sizes for pages found at start-up.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path

from pagefold.core.kv_connector import (
    ConnectorOutput,
    KVConnectorScheduler,
    KVLoad,
    KVOps,
    KVSave,
    key_from_name,
    key_name,
)
from pagefold.offload.page_file import scan

logger = logging.getLogger(__name__)


@dataclass
class OffloadStats:
    saves_host: int = 0  # entries written to the host tier
    saves_disk: int = 0
    loads_host: int = 0  # entries read back into the pool
    loads_disk: int = 0
    load_failures: int = 0  # missing / truncated / corrupt pages detected (then recomputed)
    store_failures: int = 0  # writes the disk refused
    tokens_loaded: int = 0  # prompt tokens served from the tiers instead of recomputed
    bytes_saved: int = 0
    bytes_loaded: int = 0


class OffloadIndex(KVConnectorScheduler):
    def __init__(self, *, host_slots: int, page_bytes: int, group_layers: list[int],
                 disk_dir: Path | None = None, disk_bytes: int = 0) -> None:
        self.host_slots = host_slots
        self.page_bytes = page_bytes
        self.group_layers = group_layers
        self._free_slots = list(range(host_slots - 1, -1, -1))
        self.host: OrderedDict[Hashable, list[int]] = OrderedDict()
        self.disk_dir = disk_dir
        self.disk_bytes = disk_bytes if disk_dir is not None else 0
        self.disk: OrderedDict[Hashable, int] = OrderedDict()  # key -> payload bytes
        self.disk_used = 0
        self._pinned: set[Hashable] = set()
        self._ops = KVOps()
        self.stats = OffloadStats()
        if disk_dir is not None:
            for name, size in scan(disk_dir):
                try:
                    key = key_from_name(name)
                except ValueError:
                    continue
                self.disk[key] = size
                self.disk_used += size
            self._make_room_on_disk(0)

    def describe(self) -> str:
        parts = []
        if self.host_slots:
            gib = self.host_slots * max(self.group_layers) * self.page_bytes / 2**30
            parts.append(f"host tier {self.host_slots} page slots ({gib:.2f} GiB), "
                         f"{len(self.host)} pages")
        if self.disk_dir is not None:
            parts.append(f"disk tier {self.disk_dir} capped at {self.disk_bytes / 2**30:.2f} "
                         f"GiB, holding {len(self.disk)} pages ({self.disk_used / 2**20:.1f} MiB)")
        return "; ".join(parts)

    # ------------------------------------------------------------------ queries
    def contains(self, key: Hashable) -> bool:
        return key in self.host or key in self.disk

    def wants(self, key: Hashable) -> bool:
        if key in self.disk or (key in self.host and self.disk_dir is None):
            return False
        return bool(self.host_slots or self.disk_bytes)

    @property
    def has_pending(self) -> bool:
        return bool(self._ops)

    # ------------------------------------------------------------------ decisions
    def _nbytes(self, group: int, pages: int) -> int:
        return self.group_layers[group] * pages * self.page_bytes

    def _take_host_slots(self, n: int) -> list[int]:
        """``n`` slots, evicting least recently used unpinned host entries; [] if impossible."""
        if n > self.host_slots:
            return []
        victims = iter([k for k in self.host if k not in self._pinned])
        while len(self._free_slots) < n:
            victim = next(victims, None)
            if victim is None:
                return []
            self._free_slots.extend(self.host.pop(victim))
        return [self._free_slots.pop() for _ in range(n)]

    def _make_room_on_disk(self, nbytes: int) -> bool:
        if nbytes > self.disk_bytes:
            return False
        victims = iter([k for k in self.disk if k not in self._pinned])
        while self.disk_used + nbytes > self.disk_bytes:
            victim = next(victims, None)
            if victim is None:
                return False
            self.disk_used -= self.disk.pop(victim)
            self._ops.drops.append(key_name(victim))
        return True

    def record_save(self, key: Hashable, group: int, pages: list[int],
                    saved_tokens: int) -> None:
        if not self.wants(key):
            return
        slots = [] if key in self.host else self._take_host_slots(len(pages))
        nbytes = self._nbytes(group, len(pages))
        to_disk = self.disk_dir is not None and key not in self.disk \
            and self._make_room_on_disk(nbytes)
        if not slots and not to_disk:
            return
        if slots:
            self.host[key] = slots
            self.stats.saves_host += 1
        if to_disk:
            self.disk[key] = nbytes
            self.disk_used += nbytes
            self.stats.saves_disk += 1
        self.stats.bytes_saved += nbytes
        self._ops.saves.append(KVSave(key_name(key), group, list(pages), saved_tokens,
                                      slots, to_disk))

    def pin(self, keys: list[Hashable]) -> None:
        self._pinned.update(keys)

    def record_load(self, req_id: str, key: Hashable, group: int, pages: list[int]) -> None:
        slots = self.host.get(key)
        if slots is not None:
            self.host.move_to_end(key)
            self.stats.loads_host += 1
        else:
            self.disk.move_to_end(key)
            self.stats.loads_disk += 1
        self.stats.bytes_loaded += self._nbytes(group, len(pages))
        self._pinned.add(key)
        self._ops.loads.append(KVLoad(req_id, key_name(key), group, list(pages),
                                      list(slots or ())))

    def cancel_loads(self, req_id: str) -> None:
        self._ops.cancels.append(req_id)

    def request_drain(self) -> None:
        self._ops.drain = True

    def take_ops(self) -> KVOps:
        ops, self._ops = self._ops, KVOps()
        self._pinned.clear()
        return ops

    def forget(self, key: Hashable) -> None:
        slots = self.host.pop(key, None)
        if slots:
            self._free_slots.extend(slots)
        size = self.disk.pop(key, None)
        if size is not None:
            self.disk_used -= size

    def apply_output(self, out: ConnectorOutput) -> None:
        for names in out.failed.values():
            for name in names:
                self.forget(key_from_name(name))
                self.stats.load_failures += 1
        for name in out.store_failed:
            key = key_from_name(name)
            size = self.disk.pop(key, None)
            if size is not None:
                self.disk_used -= size
            self.stats.store_failures += 1

    def check_whole(self) -> None:
        assert not self._ops and not self._pinned, "offload ops still queued"
        assert len(self._free_slots) + sum(len(s) for s in self.host.values()) \
            == self.host_slots, "host tier slots leaked"
        assert self.disk_used == sum(self.disk.values()) <= self.disk_bytes
