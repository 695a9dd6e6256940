"""Builds the offload connector from an engine's config: the index (scheduler side) joins the
cache manager, a store (worker side) joins each runner: the engine's own at TP 1, or one per
tensor-parallel rank (built in the rank's process from the plain ``OffloadPlan``; each rank
keeps its shard of every page, in memory and under its own ``rank<r>-of-<n>`` folder)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from pagefold.config import EngineConfig
from pagefold.core.kv_cache_planner import KVCacheConfig
from pagefold.offload.index import OffloadIndex
from pagefold.offload.page_file import layout_id, rank_dir
from pagefold.offload.store import OffloadStore

logger = logging.getLogger("pagefold")


@dataclass(frozen=True)
class OffloadPlan:
    """The tiers one engine asked for (plain data: it crosses a rank's process start)."""

    host_slots: int
    group_layers: tuple[int, ...]
    page_bytes: int
    disk_root: str | None
    disk_bytes: int
    layout: str
    tp_size: int

    def disk_dir(self, rank: int) -> Path | None:
        if self.disk_root is None:
            return None
        return rank_dir(Path(self.disk_root), self.layout, rank, self.tp_size)


def offload_plan(config: EngineConfig, kv_config: KVCacheConfig, *, model_dtype
                 ) -> OffloadPlan | None:
    """The tiers ``config`` asks for (None when it asks for none)."""
    host_bytes = int((config.kv_offloading_size or 0) * 2**30)
    if not host_bytes and config.kv_offloading_dir is None:
        return None
    geometry = {k: v for k, v in dataclasses.asdict(kv_config).items() if k != "num_blocks"}
    geometry.update(dtype=str(model_dtype), kv_cache_dtype=config.kv_cache_dtype,
                    quantization=config.quantization,
                    mamba_ssm_cache_dtype=config.mamba_ssm_cache_dtype)
    return OffloadPlan(
        host_slots=host_bytes // (kv_config.layers_per_group * kv_config.page_bytes),
        group_layers=tuple(len(g.layer_names) for g in kv_config.groups),
        page_bytes=kv_config.page_bytes, disk_root=config.kv_offloading_dir,
        disk_bytes=config.kv_offloading_disk_size, layout=layout_id(config.model, geometry),
        tp_size=config.tensor_parallel_size)


def build_store(plan: OffloadPlan, runner, rank: int = 0) -> OffloadStore:
    """This rank's worker side, attached to its runner."""
    store = OffloadStore(runner.cache.shared, list(plan.group_layers), plan.host_slots,
                         disk_dir=plan.disk_dir(rank), layout=plan.layout)
    runner.connector = store
    return store


def attach_offload(plan: OffloadPlan | None, kv, runner) -> OffloadIndex | None:
    """The scheduler side joins the cache manager; at TP 1 the store joins ``runner`` too
    (tensor-parallel ranks built theirs from the plan)."""
    if plan is None:
        return None
    if plan.tp_size == 1:
        build_store(plan, runner)
    index = OffloadIndex(host_slots=plan.host_slots, page_bytes=plan.page_bytes,
                         group_layers=list(plan.group_layers), disk_dir=plan.disk_dir(0),
                         disk_bytes=plan.disk_bytes)
    kv.attach_connector(index)
    kv.enable_capture_staging()  # checkpoints reach the tiers even from a full pool
    logger.info("kv offloading: %s%s", index.describe(),
                f" (per rank, {plan.tp_size} ranks)" if plan.tp_size > 1 else "")
    if kv.staging is not None:
        logger.info("kv offloading: %d pool blocks held as checkpoint staging pages",
                    kv.staging.num_blocks)
    return index
