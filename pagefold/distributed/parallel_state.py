"""This process's tensor-parallel rank and pipeline stage, and the collectives and stage
hand-offs the layers call.

Without ``init_tensor_parallel`` the process is rank 0 of 1, stage 0 of 1, and every collective
is the identity, so single-process models pay nothing. Ranks join with ``torch.distributed``
over ``env://`` (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``): gloo on the CPU,
NCCL on CUDA, so ranks on several machines join the same way.

Pipeline parallelism (``P`` stages of ``T`` tensor-parallel ranks): global rank
``r = stage * T + tp_rank``. The tensor-parallel collectives run in the stage's own group
(the default group when ``P == 1``, so a TP-only run is unchanged); stage ``s``'s rank ``t``
hands its hidden states to stage ``s + 1``'s rank ``t`` (``pp_send`` / ``pp_recv``).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TPState:
    rank: int = 0
    size: int = 1


@dataclass(frozen=True, slots=True)
class PPState:
    """This process's pipeline stage; ``layers``: the ``[start, end)`` decoder layers it
    builds and runs (None: every layer, no pipeline)."""

    stage: int = 0
    size: int = 1
    layers: tuple[int, int] | None = None


_STATE = TPState()
# ``enable_expert_parallel``: MoE layers place whole experts on the tensor-parallel ranks
# (``layers/expert_parallel.py``) instead of splitting every expert's intermediate dimension.
# Kept apart from ``TPState`` so the shard checks that save and restore (rank, size) leave it be.
_EXPERT_PARALLEL = False
_PP = PPState()
_TP_GROUP = None  # the stage's tensor-parallel process group (None: the default group)


def tp_rank() -> int:
    return _STATE.rank


def tp_size() -> int:
    return _STATE.size


def set_expert_parallel(enabled: bool) -> None:
    """Turn expert parallelism on or off for the models built from now on."""
    global _EXPERT_PARALLEL
    _EXPERT_PARALLEL = bool(enabled)


def expert_parallel_enabled() -> bool:
    """The ``enable_expert_parallel`` setting, whatever the rank count."""
    return _EXPERT_PARALLEL


def expert_parallel() -> bool:
    """True when MoE layers place whole experts on ranks: enabled with several ranks (the
    expert-parallel group is the tensor-parallel group, EP size = TP size)."""
    return _EXPERT_PARALLEL and _STATE.size > 1


def init_tensor_parallel(rank: int, size: int, backend: str = "gloo",
                         timeout_s: float = 120.0, pipeline_size: int = 1) -> None:
    """Join the process group (``env://``) as global ``rank`` of ``size * pipeline_size``:
    tensor-parallel rank ``rank % size`` of stage ``rank // size``. The stage's layer range
    is set afterwards (``set_pipeline_stage``), once the partition is known."""
    global _STATE, _PP, _TP_GROUP
    world = size * pipeline_size
    if world > 1:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    if pipeline_size > 1 and size > 1:
        # Every rank creates every stage's group, in the same order (new_group's contract).
        groups = [dist.new_group(list(range(s * size, (s + 1) * size)))
                  for s in range(pipeline_size)]
        _TP_GROUP = groups[rank // size]
    _STATE = TPState(rank % size, size)
    _PP = PPState(rank // size, pipeline_size)


def set_tensor_parallel(rank: int, size: int) -> None:
    """Set the rank the model code shards for, without a process group (building a shard)."""
    global _STATE
    _STATE = TPState(rank, size)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (in place when there are several)."""
    if _STATE.size > 1:
        dist.all_reduce(x, group=_TP_GROUP)
    return x


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """Elementwise maximum over ranks (in place when there are several)."""
    if _STATE.size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=_TP_GROUP)
    return x


def broadcast_ints(values: list[int]) -> list[int]:
    """Rank 0's ``values`` on every rank (the same length everywhere); a no-op alone. For
    decisions made from random draws (drafts, accepted counts) that every rank must share."""
    if _STATE.size == 1 or not values:
        return values
    t = torch.tensor(values, dtype=torch.int64)
    dist.broadcast(t, src=0)
    return t.tolist()


def broadcast_tensor(x: torch.Tensor) -> torch.Tensor:
    """Tensor-parallel rank 0's ``x`` on every rank of the stage (in place; ``x`` has the same
    shape and dtype everywhere); a no-op alone. For values each rank computes itself but that
    must be bit-identical across ranks (image embeddings)."""
    if _STATE.size > 1:
        src = 0 if _TP_GROUP is None else dist.get_global_rank(_TP_GROUP, 0)
        dist.broadcast(x, src=src, group=_TP_GROUP)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Concatenate the ranks' ``x`` along the last dimension (rank order)."""
    if _STATE.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.size)]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=-1)


def shard_range(n: int, what: str) -> tuple[int, int]:
    """This rank's ``[start, end)`` of ``n`` items split evenly; a ValueError naming ``what``
    when ``n`` does not divide."""
    size = _STATE.size
    if n % size:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size {size}")
    per = n // size
    return _STATE.rank * per, (_STATE.rank + 1) * per


def set_pipeline_stage(stage: int, size: int, layers: tuple[int, int] | None) -> None:
    """Set the stage (and its decoder layers) the model code builds, without a process group
    (as ``set_tensor_parallel``)."""
    global _PP
    _PP = PPState(stage, size, None if layers is None else tuple(layers))


def pp_stage() -> int:
    return _PP.stage


def pp_size() -> int:
    return _PP.size


def pp_layers() -> tuple[int, int] | None:
    """The ``[start, end)`` decoder layers this stage holds; None: all of them."""
    return _PP.layers


def pp_is_first() -> bool:
    return _PP.stage == 0


def pp_is_last() -> bool:
    return _PP.stage == _PP.size - 1


def pp_send(x: torch.Tensor) -> None:
    """Hand ``x`` to the same tensor-parallel rank of the next stage (blocking)."""
    dist.send(x.contiguous(), (_PP.stage + 1) * _STATE.size + _STATE.rank)


def pp_recv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The tensor the same tensor-parallel rank of the previous stage sent (blocking; a
    vanished peer ends in the process group's timeout, and the engine notices the death
    first: ``executor.py`` watches every rank's process)."""
    x = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(x, (_PP.stage - 1) * _STATE.size + _STATE.rank)
    return x


def close_tensor_parallel() -> None:
    global _STATE, _PP, _TP_GROUP, _EXPERT_PARALLEL
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE, _PP, _TP_GROUP = TPState(), PPState(), None
    _EXPERT_PARALLEL = False
