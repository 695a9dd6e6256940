"""Builds the transfer connector from an engine's config: the index (scheduler side) joins the
cache manager, the worker side joins the runner. One process (tensor parallelism 1)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path

from pagefold.config import EngineConfig
from pagefold.core.kv_cache_planner import KVCacheConfig
from pagefold.transfer.config import KVTransferConfig
from pagefold.transfer.index import TransferIndex
from pagefold.transfer.worker import TransferWorker

logger = logging.getLogger("pagefold")


def transfer_layout(config: EngineConfig, kv_config: KVCacheConfig, model_dtype) -> str:
    """16 hex digits naming what makes a page's bytes meaningful to another engine: the model
    (``config.json`` bytes, weight file names and sizes: copies on two machines agree), the
    dtypes, block size, page size and cache groups; not the pool's size."""
    geometry = {k: v for k, v in dataclasses.asdict(kv_config).items() if k != "num_blocks"}
    geometry.update(dtype=str(model_dtype), kv_cache_dtype=config.kv_cache_dtype,
                    quantization=config.quantization,
                    mamba_ssm_cache_dtype=config.mamba_ssm_cache_dtype)
    h = hashlib.sha256(json.dumps(geometry, sort_keys=True, default=repr).encode())
    root = Path(config.model)
    if (root / "config.json").is_file():
        h.update((root / "config.json").read_bytes())
    for f in sorted(root.glob("*.safetensors")) if root.is_dir() else ():
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def attach_transfer(config: EngineConfig, kv_config: KVCacheConfig, kv, runner, *,
                    model_dtype) -> TransferIndex | None:
    """The transfer connector ``config.kv_transfer_config`` asks for (None: none)."""
    cfg: KVTransferConfig | None = config.kv_transfer_config
    if cfg is None:
        return None
    if config.tensor_parallel_size > 1:
        raise ValueError("kv_transfer_config needs tensor_parallel_size 1 (each side's pages "
                         "travel from one process)")
    if config.kv_offloading_size or config.kv_offloading_dir:
        raise ValueError("kv_transfer_config and kv_offloading_size / kv_offloading_dir "
                         "cannot be combined (one KV connector per engine)")
    layout = transfer_layout(config, kv_config, model_dtype)
    worker = TransferWorker(runner.cache.shared, [len(g.layer_names) for g in kv_config.groups],
                            layout=layout,
                            bind=(cfg.kv_ip, cfg.kv_port) if cfg.is_producer else None,
                            keep_s=cfg.keep_s, pull_timeout_s=cfg.pull_timeout_s)
    runner.connector = worker
    index = TransferIndex(engine_id=cfg.engine_id, layout=layout,
                          block_size=kv_config.block_size, host=cfg.advertise_host,
                          port=worker.port, producer=cfg.is_producer,
                          consumer=cfg.is_consumer)
    kv.attach_connector(index)
    logger.info("%s (layout %s)", index.describe(), layout)
    return index
