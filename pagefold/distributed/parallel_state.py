"""This process's tensor-parallel rank, and the collectives the sharded layers call.

Without ``init_tensor_parallel`` the process is rank 0 of 1 and every collective is the
identity, so single-process models pay nothing. Ranks join with ``torch.distributed`` over
``env://`` (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``): gloo on the CPU,
NCCL on CUDA, so ranks on several machines join the same way.
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


_STATE = TPState()


def tp_rank() -> int:
    return _STATE.rank


def tp_size() -> int:
    return _STATE.size


def init_tensor_parallel(rank: int, size: int, backend: str = "gloo",
                         timeout_s: float = 120.0) -> None:
    """Join the process group (``env://``) as ``rank`` of ``size``."""
    global _STATE
    if size > 1:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    _STATE = TPState(rank, size)


def set_tensor_parallel(rank: int, size: int) -> None:
    """Set the rank the model code shards for, without a process group (building a shard)."""
    global _STATE
    _STATE = TPState(rank, size)


def close_tensor_parallel() -> None:
    global _STATE
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE = TPState()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (in place when there are several)."""
    if _STATE.size > 1:
        dist.all_reduce(x)
    return x


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """Elementwise maximum over ranks (in place when there are several)."""
    if _STATE.size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


def broadcast_ints(values: list[int]) -> list[int]:
    """Rank 0's ``values`` on every rank (the same length everywhere); a no-op alone. For
    decisions made from random draws (drafts, accepted counts) that every rank must share."""
    if _STATE.size == 1 or not values:
        return values
    t = torch.tensor(values, dtype=torch.int64)
    dist.broadcast(t, src=0)
    return t.tolist()


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Concatenate the ranks' ``x`` along the last dimension (rank order)."""
    if _STATE.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def shard_range(n: int, what: str) -> tuple[int, int]:
    """This rank's ``[start, end)`` of ``n`` items split evenly; a ValueError naming ``what``
    when ``n`` does not divide."""
    size = _STATE.size
    if n % size:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size {size}")
    per = n // size
    return _STATE.rank * per, (_STATE.rank + 1) * per
