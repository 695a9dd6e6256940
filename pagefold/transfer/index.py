"""The transfer connector's scheduler side.

Consumer: a request that arrives with ``kv_transfer_params`` (``do_remote_prefill``) names the
producer (host, port, its request id) and the page keys it exported. ``expect`` registers those
keys for the request when the producer's layout is this engine's, or, under another
tensor-parallel size, when its TP-independent ``model_layout`` is this engine's and every cache
group's spec can be resharded (``transfer.reshard``); else: a warning, and the request is
prefilled here. The prefix-cache hit search then counts them as stored outside the
pool (``contains``), exactly like an offload tier: the cache managers allocate the pages, the
loads leave with the next step (their sources in ``KVOps.remotes``), the request computes
nothing until the worker reports them, and a failed key (producer gone, timed out, corrupt
page) is forgotten so the request recomputes its prefill. A request's keys are released once
its loads were reported or it no longer holds pages.

Producer: when a request that asked for ``do_remote_decode`` finishes, the cache manager hands
over the cached pages of its prompt (``export``); an export op copies them out of the pool at
the start of the next step (before anything can overwrite them), and the worker keeps them
until a consumer pulls them or ``keep_s`` passes. ``export`` returns the params for the
consumer.

Invariant: the index holds no pool block; ``check_whole`` asserts nothing is queued.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from dataclasses import dataclass

from pagefold.core.kv_cache_spec import LayerSpec
from pagefold.core.kv_connector import (
    ConnectorOutput,
    KVConnectorScheduler,
    KVExport,
    KVLoad,
    KVOps,
    KVRemote,
    key_from_name,
    key_name,
)
from pagefold.core.prefix_cache import update_block_hashes
from pagefold.core.prompt_tail import TAIL, tail_hash
from pagefold.request import Request
from pagefold.transfer.reshard import why_not

logger = logging.getLogger(__name__)


@dataclass
class TransferStats:
    tokens_loaded: int = 0  # prompt tokens pulled instead of computed (consumer)
    pages_loaded: int = 0  # keys landed in the pool
    bytes_loaded: int = 0
    load_failures: int = 0  # keys that failed (timeout, producer gone, corrupt): recomputed
    refused: int = 0  # requests whose params did not fit this engine (layout, malformed)
    requests_loaded: int = 0
    exports: int = 0  # requests whose pages were exported (producer)
    pages_exported: int = 0
    bytes_exported: int = 0
    pulls: int = 0  # pulls that landed (one per request and producer; rank 0's under TP)
    pull_seconds: float = 0.0  # their wall time, request to answer


@dataclass(frozen=True)
class Remote:
    host: str
    port: int
    request_id: str
    tp_size: int = 1
    layout: str | None = None  # these three: only from a producer of another TP size
    geometry: tuple[int, tuple[int, ...]] | None = None

    def op(self, req_id: str, keys: list[str] | None = None) -> KVRemote:
        return KVRemote(req_id, self.host, self.port, self.request_id, keys or [],
                        self.tp_size, self.layout, self.geometry)


class TransferIndex(KVConnectorScheduler):
    def __init__(self, *, engine_id: str, layout: str, block_size: int, host: str,
                 port: int | None, producer: bool, consumer: bool, tp_size: int = 1,
                 model_layout: str = "", specs: tuple[LayerSpec, ...] = (),
                 page_bytes: int = 0, pages_per_state: tuple[int, ...] = ()) -> None:
        """``model_layout``: the layout without the tensor-parallel geometry; ``specs``,
        ``page_bytes``, ``pages_per_state``: this engine's cache groups (one rank's)."""
        self.engine_id = engine_id
        self.layout = layout
        self.model_layout = model_layout
        self.specs = specs
        self.page_bytes, self.pages_per_state = page_bytes, pages_per_state
        self.block_size = block_size
        self.host, self.port = host, port
        self.producer, self.consumer = producer, consumer
        self.tp_size = tp_size
        self._remotes: dict[str, Remote] = {}  # consumer request -> its producer
        self._keys: dict[str, list[Hashable]] = {}  # consumer request -> its remote keys
        # remote key -> the requests that registered it (the latest is asked first)
        self._owner: dict[Hashable, list[str]] = {}
        self._load_src: dict[tuple[str, Remote], list[str]] = {}  # (req, source) -> names
        self._pulled: set[str] = set()  # registered requests that asked for a load
        self._ops = KVOps()
        self.stats = TransferStats()

    def describe(self) -> str:
        roles = [r for r, on in (("producer", self.producer), ("consumer", self.consumer))
                 if on]
        where = f", serving pages at {self.host}:{self.port}" if self.producer else ""
        return f"kv transfer: engine {self.engine_id} as {' + '.join(roles)}{where}"

    # ------------------------------------------------------------------ consumer
    def expect(self, req: Request, params: dict) -> bool:
        """Register the keys a producer exported for ``req``; False (local prefill) when the
        params do not fit this engine, with a warning saying why."""
        why = None
        if not self.consumer:
            why = "this engine's kv_role does not consume"
        elif params.get("remote_tp_size", 1) != self.tp_size:
            why = self._mixed_refusal(params)
        elif params.get("layout") != self.layout:
            why = (f"producer layout {params.get('layout')} is not this engine's "
                   f"{self.layout} (another model, block size, dtype or cache geometry)")
        elif not all(params.get(k) for k in ("remote_host", "remote_port",
                                              "remote_request_id")):
            why = "remote_host / remote_port / remote_request_id missing"
        if why is None:
            try:
                keys = [key_from_name(n) for n in params.get("remote_block_keys") or ()]
            except (ValueError, TypeError):
                keys, why = [], "malformed remote_block_keys"
        if why is None:
            own = set(update_block_hashes(req, self.block_size))
            tail = tail_hash(req, self.block_size)
            # the chain of this very prompt only (a tail: its first L - 1 tokens exactly)
            keys = [k for k in keys if (k[-1] == tail if k[0] == TAIL else k[-1] in own)]
            if not keys:
                why = "none of the exported pages belong to this prompt (prompt or salt differ)"
        if why is not None:
            self.stats.refused += 1
            logger.warning("request %s: kv_transfer_params refused (%s); prefilling locally",
                           req.request_id, why)
            return False
        remote_tp = int(params.get("remote_tp_size", 1))
        mixed = remote_tp != self.tp_size
        self._remotes[req.request_id] = Remote(
            str(params["remote_host"]), int(params["remote_port"]),
            str(params["remote_request_id"]), remote_tp,
            str(params["layout"]) if mixed else None,
            (int(params["page_bytes"]), tuple(int(n) for n in params["pages_per_state"]))
            if mixed else None)
        self._keys[req.request_id] = keys
        for k in keys:
            self._owner.setdefault(k, []).append(req.request_id)
        return True

    def _mixed_refusal(self, params: dict) -> str | None:
        """Why a producer of another tensor-parallel size cannot serve this engine (None: its
        pages are resharded on the way in)."""
        remote_tp = params.get("remote_tp_size", 1)
        if params.get("model_layout") != self.model_layout or not self.model_layout:
            return (f"producer model layout {params.get('model_layout')} is not this engine's "
                    f"{self.model_layout} (another model, block size or dtype)")
        if not isinstance(remote_tp, int) or remote_tp < 1 \
                or not isinstance(params.get("page_bytes"), int) \
                or len(params.get("pages_per_state") or ()) != len(self.specs):
            return "malformed remote_tp_size / page_bytes / pages_per_state"
        for spec in self.specs:
            why = why_not(spec, remote_tp, self.tp_size)
            if why is not None:
                return (f"producer tensor-parallel size {remote_tp} is not this engine's "
                        f"{self.tp_size} and its pages cannot be resharded ({why})")
        return None

    def contains(self, key: Hashable) -> bool:
        return key in self._owner

    def tail_keys(self, req_id: str) -> dict[int, Hashable]:
        return {k[1]: k for k in self._keys.get(req_id, ()) if k[0] == TAIL and k in self._owner}

    def wants(self, key: Hashable) -> bool:
        return False  # evicted pages are not saved anywhere by this connector

    def record_save(self, key: Hashable, group: int, pages: list[int],
                    saved_tokens: int) -> None:
        return None

    def pin(self, keys: list[Hashable]) -> None:
        return None  # remote keys are not evicted by this engine's saves

    def record_load(self, req_id: str, key: Hashable, group: int, pages: list[int]) -> None:
        source = self._remotes[self._owner[key][-1]]  # resolved now: the owner may end first
        name = key_name(key)
        self._ops.loads.append(KVLoad(req_id, name, group, list(pages)))
        self._pulled.add(req_id)
        self._load_src.setdefault((req_id, source), []).append(name)

    def cancel_loads(self, req_id: str) -> None:
        self._ops.cancels.append(req_id)

    def release(self, req_id: str) -> None:
        remote = self._remotes.pop(req_id, None)
        if remote is not None and req_id not in self._pulled:  # its export waits for nobody
            self._ops.releases.append(remote.op(req_id))
        self._pulled.discard(req_id)
        for k in self._keys.pop(req_id, ()):
            owners = self._owner.get(k)
            if owners is not None and req_id in owners:
                owners.remove(req_id)
                if not owners:
                    del self._owner[k]

    # ------------------------------------------------------------------ producer
    def export(self, req_id: str, entries: list[tuple[Hashable, int, list[int]]],
               num_tokens: int) -> dict | None:
        if not self.producer or not entries:
            return None
        names = []
        for key, group, pages in entries:
            name = key_name(key)
            names.append(name)
            self._ops.exports.append(KVExport(req_id, name, group, list(pages)))
        self.stats.exports += 1
        self.stats.pages_exported += len(entries)
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": self.engine_id, "remote_host": self.host,
                "remote_port": self.port, "remote_request_id": req_id,
                "remote_block_keys": names, "num_tokens": num_tokens,
                "layout": self.layout, "block_size": self.block_size,
                "remote_tp_size": self.tp_size, "model_layout": self.model_layout,
                "page_bytes": self.page_bytes, "pages_per_state": list(self.pages_per_state)}

    # ------------------------------------------------------------------ steps
    def request_drain(self) -> None:
        self._ops.drain = True

    @property
    def has_pending(self) -> bool:
        return bool(self._ops)

    def take_ops(self) -> KVOps:
        ops, self._ops = self._ops, KVOps()
        for (req_id, r), names in self._load_src.items():
            ops.remotes.append(r.op(req_id, names))
        self._load_src = {}
        return ops

    def apply_output(self, out: ConnectorOutput) -> None:
        for names in out.failed.values():
            self.stats.load_failures += len(names)
            for name in names:
                self._owner.pop(key_from_name(name), None)  # recomputed, never asked again
        for rid in out.finished:
            if rid not in out.failed:
                self.stats.requests_loaded += 1
            self.release(rid)
        self.stats.pages_loaded += out.loaded_from.get("remote", 0)
        self.stats.pulls += out.pulls
        self.stats.pull_seconds += out.pull_seconds
        self.stats.bytes_loaded += out.bytes_loaded
        self.stats.bytes_exported += out.bytes_saved

    def check_whole(self) -> None:
        assert not self._ops and not self._load_src, "transfer ops still queued"
        assert not self._remotes and not self._owner and not self._pulled, \
            f"transfer expectations outlived their requests: {list(self._remotes)[:5]}"
