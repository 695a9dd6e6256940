"""Builds the transfer connector from an engine's config: the index (scheduler side) joins the
cache manager; a worker side joins each runner: the engine's own at TP 1, or one per
tensor-parallel rank (built in the rank's process from the plain ``TransferPlan``; rank ``r``
of a producer serves its shard of every page at ``kv_port + r``; rank ``r`` of a consumer pulls
from the producer's rank ``r`` when both sides have the same tensor-parallel size, else from
the producer ranks whose shards overlap its own, and reshards (``transfer.reshard``))."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from pagefold.config import EngineConfig
from pagefold.core.kv_cache_planner import KVCacheConfig
from pagefold.core.kv_cache_spec import LayerSpec, StateSpec
from pagefold.transfer.config import KVTransferConfig
from pagefold.transfer.index import TransferIndex
from pagefold.transfer.reshard import spec_at, why_not
from pagefold.transfer.worker import TransferWorker

logger = logging.getLogger("pagefold")


@dataclass(frozen=True)
class TransferPlan:
    """What every rank needs to build its worker side (plain data: it crosses a process)."""

    layout: str
    group_layers: tuple[int, ...]
    producer: bool
    kv_ip: str
    kv_port: int
    keep_s: float
    pull_timeout_s: float
    tp_size: int
    model_layout: str = ""
    specs: tuple[LayerSpec, ...] = ()  # one per cache group, one rank's
    block_size: int = 0
    page_bytes: int = 0
    pages_per_state: tuple[int, ...] = ()


def _model_hash(h, config: EngineConfig) -> str:
    root = Path(config.model)
    if (root / "config.json").is_file():
        h.update((root / "config.json").read_bytes())
    for f in sorted(root.glob("*.safetensors")) if root.is_dir() else ():
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def model_layout(config: EngineConfig, kv_config: KVCacheConfig, model_dtype) -> str:
    """16 hex digits naming what a page means whatever the tensor-parallel size: the model,
    the dtypes, the block size and every cache group's layers and spec at TP 1 ("" when a
    group cannot be resharded: no mixed tensor parallelism then)."""
    tp = config.tensor_parallel_size
    if any(why_not(g.spec, tp, 1) for g in kv_config.groups):
        return ""
    groups = [(list(g.layer_names), repr(spec_at(g.spec, 1))) for g in kv_config.groups]
    geometry = dict(groups=groups, block_size=kv_config.block_size, dtype=str(model_dtype),
                    kv_cache_dtype=config.kv_cache_dtype, quantization=config.quantization,
                    mamba_ssm_cache_dtype=config.mamba_ssm_cache_dtype)
    return _model_hash(hashlib.sha256(json.dumps(geometry, sort_keys=True).encode()), config)


def transfer_layout(config: EngineConfig, kv_config: KVCacheConfig, model_dtype) -> str:
    """16 hex digits naming what makes a page's bytes meaningful to another engine: the model
    (``config.json`` bytes, weight file names and sizes: copies on two machines agree), the
    dtypes, block size, page size, cache groups and tensor-parallel size; not the pool's
    size."""
    geometry = {k: v for k, v in dataclasses.asdict(kv_config).items() if k != "num_blocks"}
    geometry.update(dtype=str(model_dtype), kv_cache_dtype=config.kv_cache_dtype,
                    quantization=config.quantization,
                    mamba_ssm_cache_dtype=config.mamba_ssm_cache_dtype,
                    tensor_parallel_size=config.tensor_parallel_size)
    return _model_hash(hashlib.sha256(json.dumps(geometry, sort_keys=True, default=repr)
                                      .encode()), config)


def transfer_plan(config: EngineConfig, kv_config: KVCacheConfig, *, model_dtype
                  ) -> TransferPlan | None:
    """The plan ``config.kv_transfer_config`` asks for (None: no transfer)."""
    cfg: KVTransferConfig | None = config.kv_transfer_config
    if cfg is None:
        return None
    if config.kv_offloading_size or config.kv_offloading_dir:
        raise ValueError("kv_transfer_config and kv_offloading_size / kv_offloading_dir "
                         "cannot be combined (one KV connector per engine)")
    tp = config.tensor_parallel_size
    if tp > 1 and cfg.is_producer and not cfg.kv_port:
        raise ValueError("kv_transfer_config: with tensor parallelism a producer needs a fixed "
                         "kv_port (rank r serves its shard at kv_port + r)")
    return TransferPlan(
        layout=transfer_layout(config, kv_config, model_dtype),
        group_layers=tuple(len(g.layer_names) for g in kv_config.groups),
        producer=cfg.is_producer, kv_ip=cfg.kv_ip, kv_port=cfg.kv_port, keep_s=cfg.keep_s,
        pull_timeout_s=cfg.pull_timeout_s, tp_size=tp,
        model_layout=model_layout(config, kv_config, model_dtype),
        specs=tuple(g.spec for g in kv_config.groups), block_size=kv_config.block_size,
        page_bytes=kv_config.page_bytes,
        pages_per_state=tuple(g.pages_per_state if isinstance(g.spec, StateSpec) else 0
                              for g in kv_config.groups))


def build_transfer_worker(plan: TransferPlan, runner, rank: int = 0) -> TransferWorker:
    """This rank's worker side, attached to its runner."""
    port = plan.kv_port + rank if plan.kv_port else 0
    worker = TransferWorker(runner.cache.shared, list(plan.group_layers), layout=plan.layout,
                            bind=(plan.kv_ip, port) if plan.producer else None,
                            keep_s=plan.keep_s, pull_timeout_s=plan.pull_timeout_s, rank=rank,
                            tp_size=plan.tp_size, specs=plan.specs, block_size=plan.block_size,
                            pages_per_state=plan.pages_per_state)
    runner.connector = worker
    return worker


def attach_transfer(plan: TransferPlan | None, config: EngineConfig, kv, runner
                    ) -> TransferIndex | None:
    """The scheduler side joins the cache manager; at TP 1 the worker joins ``runner`` too
    (tensor-parallel ranks built theirs from the plan)."""
    if plan is None:
        return None
    cfg: KVTransferConfig = config.kv_transfer_config
    port = plan.kv_port
    if plan.tp_size == 1:
        port = build_transfer_worker(plan, runner).port
    index = TransferIndex(engine_id=cfg.engine_id, layout=plan.layout,
                          block_size=kv.block_size, host=cfg.advertise_host, port=port,
                          producer=cfg.is_producer, consumer=cfg.is_consumer,
                          tp_size=plan.tp_size, model_layout=plan.model_layout,
                          specs=plan.specs, page_bytes=plan.page_bytes,
                          pages_per_state=plan.pages_per_state)
    kv.attach_connector(index)
    logger.info("%s (layout %s%s)", index.describe(), plan.layout,
                f", {plan.tp_size} ranks at consecutive ports" if plan.tp_size > 1 else "")
    return index
