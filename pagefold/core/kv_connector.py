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

Loads may finish in a later step than the one that asked for them (asynchronous I/O): the
scheduler keeps such a request *loading* (it computes nothing) until a report names it.

Order of a step's ops on the worker, before any page copy, swap or forward of that step:
cancels, drops, then saves, then loads (a key dropped and saved again in one step keeps the
new page; a load may read what a save of the same step wrote; a save reads a page before the
step writes it, so an evicted block can be handed out in the same step).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass, field


def key_name(key: Hashable) -> str:
    """The wire / file name of a page key: ``a<group>-<hash hex>`` for an attention block
    ``(group, hash)``, ``s<group>-<hash hex>`` for a checkpoint ``("ckpt", group, hash)``,
    ``t<group>-<hash hex>`` for a prompt tail ``("tail", group, hash)`` (see
    ``core/prompt_tail.py``: never a prefix-cache entry, only transferred)."""
    if len(key) == 3:  # type: ignore[arg-type]
        kind, group, h = key  # type: ignore[misc]
        return f"{'s' if kind == 'ckpt' else 't'}{group}-{h.hex()}"
    group, h = key  # type: ignore[misc]
    return f"a{group}-{h.hex()}"


def key_group(key: Hashable) -> int:
    """The cache group a page key belongs to."""
    return key[1] if len(key) == 3 else key[0]  # type: ignore[index,arg-type]


KIND_OF_LETTER = {"s": "ckpt", "t": "tail"}


def key_from_name(name: str) -> tuple:
    """Inverse of :func:`key_name`; raises ValueError on a malformed name."""
    kind, _, rest = name.partition("-")
    if kind[:1] not in ("a", "s", "t") or not rest:
        raise ValueError(f"not a page key name: {name!r}")
    group, h = int(kind[1:]), bytes.fromhex(rest)
    return (KIND_OF_LETTER[kind[0]], group, h) if kind[0] != "a" else (group, h)


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
class KVExport:
    """Copy pool rows ``pages`` of ``group`` out under ``key`` for a consumer engine to pull
    as part of request ``req_id``'s prefill (prefill/decode disaggregation: the producer)."""

    req_id: str
    key: str
    group: int
    pages: list[int]


@dataclass(slots=True)
class KVRemote:
    """Where the loads of ``req_id`` named ``keys`` come from (prefill/decode disaggregation:
    the consumer): the producer's address and its request id. ``tp_size``, ``layout`` and
    ``geometry`` (page bytes, pages per state of each group) are the producer's, for a
    consumer of another tensor-parallel size (None: the same as the consumer's)."""

    req_id: str
    host: str
    port: int
    remote_request_id: str
    keys: list[str] = field(default_factory=list)
    tp_size: int = 1
    layout: str | None = None
    geometry: tuple[int, tuple[int, ...]] | None = None


@dataclass(slots=True)
class KVOps:
    """A step's connector work (plain data: it travels to every rank with the step).

    ``cancels``: requests whose loads must not land (aborted while loading: their pages may
    be handed out again in this very step). ``poll``: requests are loading, so the worker runs
    even without new ops (to land loads that finished). ``idle``: the step computes nothing
    else (the worker may wait briefly for a load). ``drain``: finish every queued write
    before the step ends (shutdown). A transfer connector's (prefill/decode disaggregation):
    ``exports`` (read with the saves), ``remotes`` (the sources of the loads) and
    ``releases`` (producer exports this engine will not pull: the request found its prefix in
    its own pool, or ended; the producer frees them now rather than after its timeout)."""

    drops: list[str] = field(default_factory=list)  # disk page files to delete
    saves: list[KVSave] = field(default_factory=list)
    loads: list[KVLoad] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    exports: list[KVExport] = field(default_factory=list)
    remotes: list[KVRemote] = field(default_factory=list)
    releases: list[KVRemote] = field(default_factory=list)
    poll: bool = False
    idle: bool = False
    drain: bool = False

    def __bool__(self) -> bool:
        return bool(self.drops or self.saves or self.loads or self.cancels or self.poll
                    or self.drain or self.exports or self.releases)


@dataclass(slots=True)
class ConnectorOutput:
    """What the worker side reports after a step's ops.

    ``finished``: requests whose loads are all done (ok or not); ``failed``: per request the
    keys whose page was missing, truncated or corrupt (never copied into the pool);
    ``store_failed``: keys that could not be written (disk full): the scheduler side forgets
    them. ``loaded_from``: per tier name, the pages (entries) read from it; ``bytes_*``:
    payload bytes moved; ``pulls`` / ``pull_seconds``: a transfer's pulls that landed and their
    wall time from request to answer (a consumer's latency)."""

    finished: list[str] = field(default_factory=list)
    failed: dict[str, list[str]] = field(default_factory=dict)
    store_failed: list[str] = field(default_factory=list)
    loaded_from: dict[str, int] = field(default_factory=dict)
    bytes_loaded: int = 0
    bytes_saved: int = 0
    pulls: int = 0
    pull_seconds: float = 0.0

    def count_load(self, tier: str, rows) -> None:
        """One entry's ``rows`` (its payload bytes, a uint8 tensor) landed from ``tier``."""
        self.loaded_from[tier] = self.loaded_from.get(tier, 0) + 1
        self.bytes_loaded += rows.numel()


class PendingLoads:
    """A worker's asynchronous loads, per request: how many have not landed, the keys that
    failed, the requests cancelled while loads were in flight.

    Invariant: a request is reported (``ConnectorOutput.finished``, with its failed keys)
    exactly once, when its last load lands, unless it was cancelled meanwhile; a cancelled
    request's later landings write nothing (the caller asks ``wanted`` first) and it is
    forgotten when its last one lands."""

    def __init__(self) -> None:
        self._left: dict[str, int] = {}
        self._failed: dict[str, list[str]] = {}
        self._cancelled: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self._left)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._left

    def start(self, req_id: str) -> None:
        """One more load of ``req_id`` is in flight."""
        self._left[req_id] = self._left.get(req_id, 0) + 1

    def cancel(self, req_id: str) -> None:
        if req_id in self._left:
            self._cancelled.add(req_id)
        self._failed.pop(req_id, None)

    def wanted(self, req_id: str) -> bool:
        """False when ``req_id`` was cancelled: its landing loads must not be written."""
        return req_id not in self._cancelled

    def fail(self, req_id: str, key: str) -> None:
        self._failed.setdefault(req_id, []).append(key)

    def landed(self, req_id: str, out: ConnectorOutput) -> None:
        """One load of ``req_id`` landed (written or failed); the last one reports it."""
        left = self._left[req_id] - 1
        if left:
            self._left[req_id] = left
            return
        del self._left[req_id]
        if req_id in self._cancelled:
            self._cancelled.discard(req_id)
        else:
            self.report(req_id, out)

    def report(self, req_id: str, out: ConnectorOutput) -> None:
        """``req_id``'s loads are all done: finished, with the keys that failed."""
        out.finished.append(req_id)
        failed = self._failed.pop(req_id, None)
        if failed:
            out.failed[req_id] = failed


class ReportMerger:
    """Tensor parallelism: the ranks' reports, step after step, as one report per step. Ranks
    finish a request's loads in different steps (each reads its own files): it is reported
    finished once every rank has; a key failed when it failed on any rank (its page is then
    recomputed on all of them). Counts (and pull latencies) are rank 0's, bytes the sum."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._done: dict[str, set[int]] = {}
        self._failed: dict[str, list[str]] = {}

    def merge(self, reports: list[ConnectorOutput | None], cancels: list[str]
              ) -> ConnectorOutput:
        for rid in cancels:  # aborted: some ranks will never report it
            self._done.pop(rid, None)
            self._failed.pop(rid, None)
        first = reports[0] or ConnectorOutput()
        out = ConnectorOutput(loaded_from=dict(first.loaded_from), pulls=first.pulls,
                              pull_seconds=first.pull_seconds)
        for rank, r in enumerate(reports):
            if r is None:
                continue
            for rid in r.finished:
                self._done.setdefault(rid, set()).add(rank)
            for rid, keys in r.failed.items():
                have = self._failed.setdefault(rid, [])
                have.extend(k for k in keys if k not in have)
            out.store_failed.extend(k for k in r.store_failed if k not in out.store_failed)
            out.bytes_loaded += r.bytes_loaded
            out.bytes_saved += r.bytes_saved
        for rid in [rid for rid, ranks in self._done.items() if len(ranks) == self.size]:
            del self._done[rid]
            out.finished.append(rid)
            failed = self._failed.pop(rid, None)
            if failed:
                out.failed[rid] = failed
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
    def pin(self, keys: list[Hashable]) -> None:
        """Keep ``keys`` (about to be loaded) in their tiers until the step is taken: the
        saves that the loading request's own allocations cause must not evict them."""

    @abstractmethod
    def record_load(self, req_id: str, key: Hashable, group: int, pages: list[int]) -> None:
        """Queue a load of ``key`` (pinned) into pool rows ``pages`` for ``req_id``."""

    @abstractmethod
    def cancel_loads(self, req_id: str) -> None:
        """``req_id`` ended while loading: its loads must not land (its pages are freed)."""

    @abstractmethod
    def request_drain(self) -> None:
        """The next step's ops finish every queued write before the step ends."""

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

    def tail_keys(self, req_id: str) -> dict[int, Hashable]:
        """The prompt-tail keys registered for ``req_id``, per cache group (prefill/decode
        disaggregation: the producer's partial last block and state after all but the last
        prompt token; see ``core/prompt_tail.py``); empty by default."""
        return {}

    def release(self, req_id: str) -> None:  # noqa: B027 - nothing is per request by default
        """``req_id`` no longer holds pages (finished, aborted, preempted or starting over)."""

    def export(self, req_id: str, entries: list[tuple[Hashable, int, list[int]]],
               num_tokens: int) -> dict | None:
        """A finished prefill's cached pages ``(key, group, pool rows)`` leave for another
        engine (covering ``num_tokens`` prompt tokens); returns the ``kv_transfer_params``
        that engine needs, or None when this connector does not export."""
        return None


class KVConnectorWorker(ABC):
    """Worker side: runs a step's ops against this rank's pool tensors."""

    @abstractmethod
    def run(self, ops: KVOps) -> ConnectorOutput:
        """Execute drops, saves, then loads (the module docstring's order); a load may land
        in a later step's ``run`` (asynchronous), its request reported then."""

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Finish queued work and release threads (the runner is going away)."""
