"""Data parallelism: N engine cores (each its own process, pool and scheduler; each may be
tensor-parallel itself) behind one API server.

``DPEngineClient`` has the interface of :class:`~pagefold.engine.client.AsyncEngineClient`
and routes every request to one replica, chosen by :class:`LoadBalancer`:

* load: requests this server has in flight on the replica plus the replica's waiting queue,
  then its KV-cache usage (from the stats every core sends with its outputs);
* prefix-aware: the balancer remembers which replica last served each prompt prefix (hashes
  of the first 1, 2, 4, ... blocks); a request whose longest known prefix lives on a replica
  goes there unless that replica is busier than the least loaded one by more than
  ``prefix_slack`` requests (then two replicas could serve it and load decides).

Aborts go to the replica that holds the request. If any replica dies, the server is dead
(``EngineDeadError``, HTTP 503): a request never waits on a replica that cannot answer.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pagefold.config import EngineConfig
from pagefold.engine.client import AsyncEngineClient, EngineDeadError
from pagefold.outputs import RequestOutput
from pagefold.sampling_params import SamplingParams


@dataclass(slots=True)
class ReplicaLoad:
    in_flight: int = 0
    waiting: int = 0
    kv_usage: float = 0.0

    @property
    def key(self) -> tuple[int, float]:
        return (self.in_flight + self.waiting, self.kv_usage)


class LoadBalancer:
    """Picks a replica for a prompt; remembers prefixes (bounded LRU of ``max_prefixes``)."""

    def __init__(self, num_replicas: int, block_size: int = 16, *, prefix_slack: int = 4,
                 max_prefixes: int = 100_000) -> None:
        self.n = num_replicas
        self.block_size = block_size
        self.prefix_slack = prefix_slack
        self.max_prefixes = max_prefixes
        self._owner: OrderedDict[bytes, int] = OrderedDict()

    def _prefix_keys(self, prompt: list[int]) -> list[bytes]:
        """Hashes of the prompt's first 1, 2, 4, ... full blocks (longest last)."""
        keys, blocks = [], 1
        while blocks * self.block_size <= len(prompt) - 1:  # a hit needs one token after it
            data = ",".join(map(str, prompt[: blocks * self.block_size])).encode()
            keys.append(hashlib.blake2b(data, digest_size=16).digest())
            blocks *= 2
        return keys

    def pick(self, prompt: list[int], loads: list[ReplicaLoad]) -> int:
        least = min(range(self.n), key=lambda i: (loads[i].key, i))
        keys = self._prefix_keys(prompt)
        choice = least
        for k in reversed(keys):
            owner = self._owner.get(k)
            if owner is not None:
                busy = loads[owner].in_flight + loads[owner].waiting
                floor = loads[least].in_flight + loads[least].waiting
                if busy <= floor + self.prefix_slack:
                    choice = owner
                break
        for k in keys:
            self._owner[k] = choice
            self._owner.move_to_end(k)
        while len(self._owner) > self.max_prefixes:
            self._owner.popitem(last=False)
        return choice


class DPEngineClient:
    def __init__(self, config: EngineConfig, num_replicas: int, tokenizer=None, *,
                 metrics=None, log_level: str = "INFO", startup_timeout: float = 600.0
                 ) -> None:
        if num_replicas < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {num_replicas}")
        self.config = config
        self.replicas = [AsyncEngineClient(config, tokenizer, metrics=metrics,
                                           log_level=log_level, startup_timeout=startup_timeout)
                         for _ in range(num_replicas)]
        self.balancer = LoadBalancer(num_replicas, config.block_size)
        self._owner: dict[str, int] = {}
        self.routed = [0] * num_replicas  # requests sent to each replica (tests, logs)

    # The server sets these after construction; every replica needs them.
    @property
    def tokenizer(self):
        return self.replicas[0].tokenizer

    @tokenizer.setter
    def tokenizer(self, value) -> None:
        for r in self.replicas:
            r.tokenizer = value

    @property
    def metrics(self):
        return self.replicas[0].metrics

    @metrics.setter
    def metrics(self, value) -> None:
        for r in self.replicas:
            r.metrics = value

    @property
    def info(self):
        return self.replicas[0].info

    @property
    def core_pid(self) -> int | None:
        return self.replicas[0].core_pid

    @property
    def core_pids(self) -> list[int | None]:
        return [r.core_pid for r in self.replicas]

    @property
    def is_alive(self) -> bool:
        return all(r.is_alive for r in self.replicas)

    @property
    def dead_reason(self) -> str | None:
        for i, r in enumerate(self.replicas):
            reason = r.dead_reason
            if reason is not None:
                return f"data-parallel replica {i}: {reason}"
        return None

    @property
    def num_in_flight(self) -> int:
        return sum(r.num_in_flight for r in self.replicas)

    def check_alive(self) -> None:
        for i, r in enumerate(self.replicas):
            if not r.is_alive:
                raise EngineDeadError(f"data-parallel replica {i}: "
                                      f"{r.dead_reason or 'not running'}")

    # ------------------------------------------------------------------ lifecycle
    def spawn(self) -> None:
        for r in self.replicas:
            r.spawn()

    async def start(self):
        try:
            await asyncio.gather(*(r.start() for r in self.replicas))
        except BaseException:
            await self.shutdown(timeout=0.5)
            raise
        return self.info

    async def shutdown(self, timeout: float = 5.0) -> None:
        await asyncio.gather(*(r.shutdown(timeout) for r in self.replicas),
                             return_exceptions=True)

    def kill_now(self) -> None:
        for r in self.replicas:
            r.kill_now()

    # ------------------------------------------------------------------ requests
    def loads(self) -> list[ReplicaLoad]:
        out = []
        for r in self.replicas:
            st = r.last_stats
            out.append(ReplicaLoad(r.num_in_flight, int(getattr(st, "num_waiting", 0) or 0),
                                   float(getattr(st, "kv_usage", 0.0) or 0.0)))
        return out

    async def generate(self, prompt: str | None, prompt_token_ids: list[int],
                       params: SamplingParams, *, request_id: str,
                       priority: int = 0, **kw) -> AsyncIterator[RequestOutput]:
        """The request on the replica the balancer picks (``kw``: ``cache_salt``,
        ``mm_inputs``, ``lora_request``, as :meth:`AsyncEngineClient.generate`)."""
        self.check_alive()
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        i = self.balancer.pick(list(prompt_token_ids), self.loads())
        self._owner[request_id] = i
        self.routed[i] += 1
        inner = self.replicas[i].generate(prompt, prompt_token_ids, params,
                                          request_id=request_id, priority=priority, **kw)
        try:
            async for out in inner:
                yield out
        finally:
            self._owner.pop(request_id, None)
            await inner.aclose()  # a consumer that left early aborts the request there

    def abort(self, request_id: str) -> None:
        i = self._owner.pop(request_id, None)
        if i is not None:
            self.replicas[i].abort(request_id)

    async def utility(self, method: str, timeout: float = 10.0) -> Any:
        """``ping``: every replica; ``pool_stats``: counters summed over replicas, ``whole``
        when every pool is whole, ``kv_usage`` the mean, and ``replicas`` each one's own."""
        self.check_alive()
        results = await asyncio.gather(*(r.utility(method, timeout) for r in self.replicas))
        if method != "pool_stats":
            return results[0]
        merged: dict[str, Any] = {}
        for key, value in results[0].items():
            if isinstance(value, bool):
                merged[key] = all(r[key] for r in results)
            elif isinstance(value, int | float):
                merged[key] = sum(r[key] for r in results)
        merged["kv_usage"] = sum(r["kv_usage"] for r in results) / len(results)
        q = merged.get("prefix_queries", 0)
        merged["prefix_hit_rate"] = merged.get("prefix_hits", 0) / q if q else 0.0
        merged["replicas"] = results
        return merged
