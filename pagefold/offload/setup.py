"""Builds the offload connector from an engine's config: the index (scheduler side) joins the
cache manager, the store (worker side) joins the runner."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from pagefold.config import EngineConfig
from pagefold.core.kv_cache_planner import KVCacheConfig
from pagefold.offload.index import OffloadIndex
from pagefold.offload.page_file import layout_id, rank_dir
from pagefold.offload.store import OffloadStore

logger = logging.getLogger("pagefold")


def attach_offload(config: EngineConfig, kv_config: KVCacheConfig, kv, runner, *,
                   model_dtype) -> OffloadIndex | None:
    """Attach the host / disk tiers that ``config`` asks for (None when it asks for none).

    Raises ValueError under tensor parallelism (each rank would keep its shard; the ranks'
    load reports are not gathered yet)."""
    host_bytes = int((config.kv_offloading_size or 0) * 2**30)
    if not host_bytes and config.kv_offloading_dir is None:
        return None
    if config.tensor_parallel_size > 1:
        raise ValueError("kv_offloading_size / kv_offloading_dir with tensor_parallel_size > 1 "
                         "is not supported yet")
    slots = host_bytes // (kv_config.layers_per_group * kv_config.page_bytes)
    group_layers = [len(g.layer_names) for g in kv_config.groups]
    geometry = {k: v for k, v in dataclasses.asdict(kv_config).items() if k != "num_blocks"}
    geometry.update(dtype=str(model_dtype), kv_cache_dtype=config.kv_cache_dtype,
                    quantization=config.quantization,
                    mamba_ssm_cache_dtype=config.mamba_ssm_cache_dtype)
    layout = layout_id(config.model, geometry)
    disk_dir = None
    if config.kv_offloading_dir is not None:
        disk_dir = rank_dir(Path(config.kv_offloading_dir), layout, 0, 1)
    store = OffloadStore(runner.cache.shared, group_layers, slots, disk_dir=disk_dir,
                         layout=layout)
    index = OffloadIndex(host_slots=slots, page_bytes=kv_config.page_bytes,
                         group_layers=group_layers, disk_dir=disk_dir,
                         disk_bytes=config.kv_offloading_disk_size)
    runner.connector = store
    kv.attach_connector(index)
    logger.info("kv offloading: %s", index.describe())
    return index
