"""``--kv-transfer-config``: vLLM's KVTransferConfig fields, parsed and checked.

Roles: ``kv_producer`` runs prefills and exports their pages (it binds a ZMQ server at
``kv_ip:kv_port``), ``kv_consumer`` pulls pages named by a request's ``kv_transfer_params``,
``kv_both`` does both. ``kv_connector_extra_config`` takes ``pull_timeout_s`` (how long a
consumer waits for a producer before recomputing the prefill itself), ``keep_s`` (how long a
producer keeps an export nobody pulled), ``advertise_host`` (the host a consumer should dial,
when ``kv_ip`` is a wildcard such as ``0.0.0.0``) and ``engine_id``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from pagefold.json_option import json_object

ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("PagefoldConnector", "P2pZmqConnector")  # the second: a vLLM-style alias
EXTRA_KEYS = {"pull_timeout_s", "keep_s", "advertise_host", "engine_id"}


@dataclass
class KVTransferConfig:
    kv_connector: str = "PagefoldConnector"
    kv_role: str = "kv_both"
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579  # vLLM's default; 0 picks a free port (reported in the params)
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_buffer_device: str = "cpu"
    kv_buffer_size: float = 1e9
    engine_id: str | None = None

    def __post_init__(self) -> None:
        if self.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_transfer_config: kv_connector {self.kv_connector!r} is not "
                             f"available; pagefold has {', '.join(CONNECTORS)}")
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {', '.join(ROLES)}, "
                             f"got {self.kv_role!r}")
        if not isinstance(self.kv_port, int) or not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config: kv_port must be a port number, got "
                             f"{self.kv_port!r}")
        extra = self.kv_connector_extra_config or {}
        unknown = sorted(set(extra) - EXTRA_KEYS)
        if unknown:
            raise ValueError(f"kv_transfer_config: kv_connector_extra_config has unknown "
                             f"key(s) {unknown}; known: {sorted(EXTRA_KEYS)}")
        for k in ("pull_timeout_s", "keep_s"):
            if k in extra and not (isinstance(extra[k], (int, float)) and extra[k] > 0):
                raise ValueError(f"kv_transfer_config: {k} must be a positive number")
        self.engine_id = self.engine_id or extra.get("engine_id") or uuid.uuid4().hex[:16]

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def pull_timeout_s(self) -> float:
        return float(self.kv_connector_extra_config.get("pull_timeout_s", 10.0))

    @property
    def keep_s(self) -> float:
        return float(self.kv_connector_extra_config.get("keep_s", 120.0))

    @property
    def advertise_host(self) -> str:
        host = self.kv_connector_extra_config.get("advertise_host")
        if host:
            return str(host)
        return "127.0.0.1" if self.kv_ip in ("0.0.0.0", "*", "") else self.kv_ip

    @classmethod
    def from_user(cls, value: KVTransferConfig | dict | str | None) -> KVTransferConfig | None:
        """A dict, its JSON, or a config; ``None`` / ``{}`` mean off."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        value = json_object(value, "kv_transfer_config")
        if not value:
            return None
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_transfer_config has unknown key(s) {unknown}; known: "
                             f"{sorted(known)}")
        return cls(**value)
