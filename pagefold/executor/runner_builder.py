"""The one way a :class:`ModelRunner` is built from a checkpoint: the model of ``arch`` with
its weights, then the runner over the pool. The engine builds its runner with it at tensor
parallelism 1; every tensor-parallel rank builds its shard's runner with it
(``distributed/worker.py``), so both sides get the same runner for the same arguments."""

from __future__ import annotations

from pathlib import Path

import torch

from pagefold.core.kv_cache_planner import KVCacheConfig
from pagefold.executor.model_runner import ModelRunner
from pagefold.models.registry import load_model

__all__ = ["build_runner"]


def build_runner(model: str, hf_config, arch: str, dtype: torch.dtype, max_positions: int,
                 device: torch.device, kv_config: KVCacheConfig, *,
                 cache_fill: float | None = None, num_host_blocks: int = 0,
                 quantization: str | None = None) -> ModelRunner:
    """A runner over a fresh pool for ``kv_config`` holding the model of ``arch`` loaded from
    the checkpoint folder ``model`` (this rank's shard under tensor parallelism), its weights
    quantized as ``quantization`` says (see ``load_model``)."""
    loaded = load_model(Path(model), hf_config, arch, dtype, max_positions, device,
                        quantization)
    return ModelRunner(loaded, kv_config, device, cache_fill=cache_fill,
                       num_host_blocks=num_host_blocks)
