"""The KV connector: how pages leave the block pool and come back (offload tiers, transfer).

Shaped like vLLM's KV connector, in two halves that talk only through the step message:

* The **scheduler side** (:class:`KVConnectorScheduler`, in the engine core) answers "is the
  page under this key available outside the pool" (``contains``), decides where a page that
  leaves the pool goes (``record_save``), and turns its decisions into plain ops that travel in
  ``SchedulerOutput.kv_ops`` (``take_ops``). It never touches page bytes.
* The **worker side** (:class:`KVConnectorWorker`, one per runner / tensor-parallel rank, each
  holding its own shard of every page) executes a step's ops around the forward and reports
  per request which loads finished and which keys failed (:class:`ConnectorOutput`).

Keys are the prefix cache's own: an attention block's ``(group, hash)`` and a state
checkpoint's ``("ckpt", group, hash)``; the hash chain starts from the request's extra keys
(``cache_salt``), so salted prefixes never meet. On the wire and on disk a key is its
:func:`key_name` (``a<group>-<hex>`` / ``s<group>-<hex>``). Attention pages and state
checkpoint pages go through the connector alike: a key names ``n`` page rows of one group
(1 for an attention block, ``pages_per_state`` for a checkpoint) in each of the group's
layers.

Which keys a request's prefix needs, and what a load means for a kind of page (attention: a
block registered in the prefix cache; state: the request's own state pages), is the policy of
the cache managers (``core/managers.py``); the scheduler only sees "this request is loading".

Order of a step's ops on the worker, before any page copy, swap or forward of that step:
drops, then saves, then loads (a key dropped and saved again in one step keeps the new page;
a load may read what a save of the same step wrote; a save reads a page before the step
writes it, so an evicted block can be handed out in the same step).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass, field


def key_name(key: Hashable) -> str:
    """The wire / file name of a prefix-cache key: ``a<group>-<hash hex>`` for an attention
    block ``(group, hash)``, ``s<group>-<hash hex>`` for a checkpoint ``("ckpt", group, hash)``."""
    if len(key) == 3:  # type: ignore[arg-type]
        _, group, h = key  # type: ignore[misc]
        return f"s{group}-{h.hex()}"
    group, h = key  # type: ignore[misc]
    return f"a{group}-{h.hex()}"


def key_group(key: Hashable) -> int:
    """The cache group a prefix-cache key belongs to."""
    return key[1] if len(key) == 3 else key[0]  # type: ignore[index,arg-type]


def key_from_name(name: str) -> tuple:
    """Inverse of :func:`key_name`; raises ValueError on a malformed name."""
    kind, _, rest = name.partition("-")
    if kind[:1] not in ("a", "s") or not rest:
        raise ValueError(f"not a page key name: {name!r}")
    group, h = int(kind[1:]), bytes.fromhex(rest)
    return ("ckpt", group, h) if kind[0] == "s" else (group, h)


@dataclass(slots=True)
class KVSave:
    """Copy the page rows ``pages`` of ``group`` (every layer) out of the pool under ``key``:
    into host slots ``host_slots`` (empty: not to host) and/or a disk page file."""

    key: str
    group: int
    pages: list[int]
    saved_tokens: int
    host_slots: list[int] = field(default_factory=list)
    to_disk: bool = False


@dataclass(slots=True)
class KVLoad:
    """Copy the page stored under ``key`` into pool rows ``pages`` of ``group`` for request
    ``req_id``: from host slots ``host_slots`` when given, else from its disk page file."""

    req_id: str
    key: str
    group: int
    pages: list[int]
    host_slots: list[int] = field(default_factory=list)


@dataclass(slots=True)
class KVOps:
    """A step's connector work (plain data: it travels to every rank with the step)."""

    drops: list[str] = field(default_factory=list)  # disk page files to delete
    saves: list[KVSave] = field(default_factory=list)
    loads: list[KVLoad] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.drops or self.saves or self.loads)


@dataclass(slots=True)
class ConnectorOutput:
    """What the worker side reports after a step's ops.

    ``finished``: requests whose loads are all done (ok or not); ``failed``: per request the
    keys whose page was missing, truncated or corrupt (never copied into the pool);
    ``store_failed``: keys that could not be written (disk full): the scheduler side forgets
    them. ``loaded_from``: per tier name, the pages (entries) read from it; ``bytes_*``:
    payload bytes moved."""

    finished: list[str] = field(default_factory=list)
    failed: dict[str, list[str]] = field(default_factory=dict)
    store_failed: list[str] = field(default_factory=list)
    loaded_from: dict[str, int] = field(default_factory=dict)
    bytes_loaded: int = 0
    bytes_saved: int = 0


def merge_outputs(reports: list[ConnectorOutput]) -> ConnectorOutput:
    """One report from every tensor-parallel rank's (rank 0 first): a request's loads are
    finished when every rank finished them, a key failed when it failed on any rank (its page
    is then recomputed on all of them); counts are rank 0's, bytes the sum."""
    first = reports[0]
    done = set(first.finished)
    for r in reports[1:]:
        done &= set(r.finished)
    out = ConnectorOutput(finished=[rid for rid in first.finished if rid in done],
                          loaded_from=dict(first.loaded_from))
    for r in reports:
        for rid, keys in r.failed.items():
            have = out.failed.setdefault(rid, [])
            have.extend(k for k in keys if k not in have)
        out.store_failed.extend(k for k in r.store_failed if k not in out.store_failed)
        out.bytes_loaded += r.bytes_loaded
        out.bytes_saved += r.bytes_saved
    return out


class KVConnectorScheduler(ABC):
    """Scheduler side: an index of what lies outside the pool, and the ops of the next step."""

    @abstractmethod
    def contains(self, key: Hashable) -> bool:
        """Whether a page stored under ``key`` can be loaded (a later load may still fail)."""

    @abstractmethod
    def wants(self, key: Hashable) -> bool:
        """Whether a page leaving the pool under ``key`` should be saved."""

    @abstractmethod
    def record_save(self, key: Hashable, group: int, pages: list[int],
                    saved_tokens: int) -> None:
        """Queue a save of pool rows ``pages`` (read at the start of the next step sent)."""

    @abstractmethod
    def record_load(self, req_id: str, key: Hashable, group: int, pages: list[int]) -> None:
        """Queue a load of ``key`` into pool rows ``pages`` for ``req_id``."""

    @abstractmethod
    def take_ops(self) -> KVOps:
        """The queued ops, for the step being sent."""

    @abstractmethod
    def apply_output(self, out: ConnectorOutput) -> None:
        """Learn from the worker's report (forget failed keys, count)."""

    @property
    @abstractmethod
    def has_pending(self) -> bool:
        """Ops are queued for the next step."""


class KVConnectorWorker(ABC):
    """Worker side: runs a step's ops against this rank's pool tensors."""

    @abstractmethod
    def run(self, ops: KVOps) -> ConnectorOutput:
        """Execute drops, saves, then loads (the module docstring's order)."""
