"""Pipeline parallelism's layer split: which contiguous decoder layers each stage holds.

The cost of a layer is its parameter count on one tensor-parallel rank (counted on a
meta-device build, no memory): a decode step's time on the CPU follows the weights it reads,
and the count tells an attention layer, a Gated DeltaNet or Mamba-2 layer and an MoE layer
apart as they are. Stages are the contiguous split whose most expensive stage is cheapest
(ties: the earliest such split). ``PAGEFOLD_PP_LAYER_PARTITION="3,5"`` (layers per stage, as
vLLM's ``VLLM_PP_LAYER_PARTITION``) overrides it.

Only a model whose decoder goes through the shared ``DecoderStack`` (``layers/decoder_stack``)
can be cut; any other is refused at ``pipeline_parallel_size > 1`` naming the architecture.
"""

from __future__ import annotations

import logging
import os

import torch

from pagefold.core.kv_cache_planner import KVCacheConfig, plan_stages
from pagefold.distributed.parallel_state import (
    pp_layers,
    pp_size,
    pp_stage,
    set_pipeline_stage,
    set_tensor_parallel,
    tp_rank,
    tp_size,
)
from pagefold.layers.decoder_stack import DecoderStack
from pagefold.models.registry import model_class

__all__ = ["ENV_PARTITION", "layer_costs", "partition_layers", "plan_pipeline", "split_for"]

logger = logging.getLogger("pagefold")

ENV_PARTITION = "PAGEFOLD_PP_LAYER_PARTITION"


def layer_costs(arch: str, tcfg, tensor_parallel_size: int = 1) -> list[int]:
    """Parameters of each decoder layer on one tensor-parallel rank; a ValueError naming
    ``arch`` when its model does not build through ``DecoderStack``."""
    prev_tp, prev_pp = (tp_rank(), tp_size()), (pp_stage(), pp_size(), pp_layers())
    set_tensor_parallel(0, tensor_parallel_size)
    set_pipeline_stage(0, 1, None)
    try:
        with torch.device("meta"):
            model = model_class(arch)(tcfg, max_positions=2)
    finally:
        set_tensor_parallel(*prev_tp)
        set_pipeline_stage(*prev_pp)
    stacks = [m for m in model.modules() if isinstance(m, DecoderStack)]
    if not stacks:
        raise ValueError(f"pipeline parallelism is not supported for {arch}: its model does not "
                         "build through the shared DecoderStack (pagefold/layers/"
                         "decoder_stack.py); use pipeline_parallel_size 1")
    return [sum(p.numel() for p in layer.parameters()) for layer in stacks[0].layers]


def partition_layers(costs: list[int], stages: int) -> list[tuple[int, int]]:
    """The contiguous ``[start, end)`` spans of ``stages`` non-empty stages whose largest
    summed cost is smallest (the earliest cut among equals)."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"pipeline_parallel_size {stages} needs at least that many decoder "
                         f"layers; the model has {n}")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the smallest largest-stage cost of the first i layers in s stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                v = max(best[s - 1][j], prefix[i] - prefix[j])
                if v < best[s][i]:
                    best[s][i], cut[s][i] = v, j
    spans, i = [], n
    for s in range(stages, 0, -1):
        spans.append((cut[s][i], i))
        i = cut[s][i]
    return spans[::-1]


def _override(text: str, n: int, stages: int) -> list[tuple[int, int]]:
    try:
        counts = [int(c) for c in text.split(",")]
    except ValueError:
        counts = []
    if len(counts) != stages or sum(counts) != n or min(counts, default=0) < 1:
        raise ValueError(f"{ENV_PARTITION}={text!r}: give {stages} positive layer counts "
                         f"(comma-separated) summing to the model's {n} decoder layers")
    spans, start = [], 0
    for c in counts:
        spans.append((start, start + c))
        start += c
    return spans


def split_for(arch: str, tcfg, stages: int, tensor_parallel_size: int = 1
              ) -> list[tuple[int, int]]:
    """The stages' ``[start, end)`` layer spans for ``arch`` (the override, else the balanced
    split), logged with each stage's cost."""
    costs = layer_costs(arch, tcfg, tensor_parallel_size)
    text = os.environ.get(ENV_PARTITION)
    spans = (_override(text, len(costs), stages) if text
             else partition_layers(costs, stages))
    logger.info("pipeline parallel: %d stages, layers %s (parameters per stage %s)%s",
                stages, ", ".join(f"{a}-{b - 1}" for a, b in spans),
                [sum(costs[a:b]) for a, b in spans],
                f" from {ENV_PARTITION}" if text else "")
    return spans


def plan_pipeline(arch: str, tcfg, layer_specs: dict, block_size: int, memory_bytes: int,
                  stages: int, tensor_parallel_size: int = 1
                  ) -> tuple[list[tuple[int, int]], KVCacheConfig, list[KVCacheConfig]]:
    """``(layer spans, the scheduler's pool config, each stage's pool config)`` for
    ``stages`` stages of ``memory_bytes`` each: what the engine builds and what
    ``pagefold capacity --pipeline-parallel-size`` reports (``plan_stages``)."""
    spans = split_for(arch, tcfg, stages, tensor_parallel_size)
    sched, per_stage = plan_stages(layer_specs, block_size, memory_bytes, spans)
    return spans, sched, per_stage
