"""Staging pages: state checkpoints reach the offload tiers even when the pool has no room.

A state checkpoint is captured inside the prefill kernels into pool pages (``plan_capture``);
with every page held by running requests (a tight pool under high concurrency) there are
none, the capture used to be skipped, and a later hybrid hit on that prefix was impossible
(it needs a checkpoint). With an offload connector the manager holds a few state-sized page
sets out of the pool (the *staging reserve*, taken at start-up). A capture the pool cannot
hold goes into a staging set instead; after its step the checkpoint is not registered in the
pool but handed to the connector as a save (``record_save``: to the host / disk tier), and the
set returns to the reserve once the step that executed the save ran (a save reads its rows at
the start of that step, before the forward).

Invariants: a staging set is in exactly one of free, captured (written by the running step),
queued (its save leaves with the next step) or in flight (that step is running); the reserve's
blocks are never freed to the pool and never a cache entry (``BlockPool.reserve``: they do
not count as usable).
"""

from __future__ import annotations

from collections.abc import Hashable

from pagefold.core.block_pool import Block, BlockPool
from pagefold.core.kv_connector import KVConnectorScheduler

# Staging sets per state group: at most this many, and at most 1/16 of the pool in all.
MAX_SETS = 8


class CaptureStaging:
    def __init__(self, pool: BlockPool, connector: KVConnectorScheduler,
                 pages_per_state: list[int]) -> None:
        """``pages_per_state``: one entry per state group."""
        total = sum(pages_per_state)
        sets = max(1, min(MAX_SETS, pool.num_usable // (16 * total))) if total else 0
        self.connector = connector
        self._free: dict[int, list[list[Block]]] = {}
        for pps in pages_per_state:
            for _ in range(sets):
                self._free.setdefault(pps, []).append(pool.reserve(pps))
        self.num_blocks = sets * total
        self._queued: list[list[Block]] = []
        self._in_flight: list[list[Block]] = []
        self.staged = 0  # checkpoints that went to the tiers through a staging set

    def take(self, key: Hashable, pages: int) -> list[Block] | None:
        """A free set of ``pages`` pages for a checkpoint under ``key``; None when none is
        free or the connector would not save it (already stored)."""
        free = self._free.get(pages)
        if not free or self.connector.contains(key) or not self.connector.wants(key):
            return None
        return free.pop()

    def give_back(self, blocks: list[Block]) -> None:
        """A set whose capture did not happen (its request ended first)."""
        self._free[len(blocks)].append(blocks)

    def captured(self, key: Hashable, group: int, blocks: list[Block], num_tokens: int
                 ) -> None:
        """The step wrote the checkpoint: save it to the tiers with the next step."""
        self.connector.record_save(key, group, [b.block_id for b in blocks], num_tokens)
        self._queued.append(blocks)
        self.staged += 1

    def step_sent(self) -> None:
        """The next step (carrying the queued saves) is being sent."""
        self._in_flight.extend(self._queued)
        self._queued = []

    def step_done(self) -> None:
        """The step that carried the saves ran: their sets are free again."""
        for blocks in self._in_flight:
            self.give_back(blocks)
        self._in_flight = []

    def check_idle(self) -> None:
        assert not self._queued and not self._in_flight, "staged checkpoint saves pending"
        held = sum(len(s) for sets in self._free.values() for s in sets)
        assert held == self.num_blocks, "a staging set is missing"


def stage_captures(pool: BlockPool, connector: KVConnectorScheduler, managers: list
                   ) -> CaptureStaging | None:
    """The staging reserve for the state groups among ``managers`` (``core.managers``: each
    state manager takes it as its ``staging``); None without state groups."""
    states = [m for m in managers if m.wants_checkpoints()]
    if not states:
        return None
    staging = CaptureStaging(pool, connector, [m.group.pages_per_state for m in states])
    for m in states:
        m.staging = staging
    return staging
