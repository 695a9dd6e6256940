"""Expert parallelism (``enable_expert_parallel``): whole experts on ranks, exact combine.

Without it, tensor parallelism splits every expert's intermediate dimension over the ranks
(``layers/moe.py``). With it, the expert-parallel group is the tensor-parallel group (EP size =
TP size; pagefold has no data-parallel ranks inside one engine, so vLLM's ``EP = TP x DP`` is
``EP = TP`` here) and rank ``r`` holds experts ``[r * E/N, (r + 1) * E/N)`` whole: full
intermediate width, the checkpoint's rows of those experts and nothing of the others. An
``E`` that ``N`` does not divide is a ValueError naming both numbers.

Dispatch and combine. Attention and the state layers keep every token's hidden state on every
rank (they are tensor-parallel), and the router is replicated, so every rank already holds every
token and knows every token's chosen experts: dispatch is local (each rank gathers the tokens
routed to its own experts; nothing is sent). The combine must bring each (token, slot)
contribution ``w * expert(x)`` from the rank that computed it to every rank. pagefold does it
with one all-reduce of a ``(T, k, H)`` buffer in which each rank has written only its own slots
(zeros elsewhere): every element is non-zero on exactly one rank, and adding zeros is exact,
so the all-reduce moves values without rounding them -- an all-gather of the slots, with any
backend's collective (gloo, NCCL) and no variable-size all-to-all. Each rank then adds a
token's ``k`` contributions in ascending expert order into zeros, which is exactly the order
(and so the float bits) of the one-rank path and of transformers (``index_add_`` expert by
expert): the routed sum of an MoE layer under EP is bit-identical to TP=1's for the same
input. (vLLM's TP-without-DP path sums each rank's partial output with one all-reduce, whose
order differs from one rank's.) The cost is ``k`` times the hidden state per token in the
collective instead of one; a true all-to-all of only the owned rows would move less but needs
variable sizes, and no more exactness.

Shared experts and dense parts stay tensor-parallel (intermediate dimension split): their
partial sums ride in the same all-reduce (the ``extra`` rows), so an EP MoE layer issues one
collective like a TP one. The model as a whole is therefore not bit-identical to TP=1 (its
attention and shared experts reduce partial sums, as at TP=2 without EP); greedy tokens match
transformers as they do at TP=2.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagefold.distributed.parallel_state import all_reduce, expert_parallel, tp_rank, tp_size

__all__ = ["ExpertShard", "expert_shard", "routed_ep", "shard_experts"]


@dataclass(frozen=True, slots=True)
class ExpertShard:
    """This rank's experts: global ids ``[first, first + count)`` of ``total``."""

    total: int
    first: int
    count: int

    def owns(self, e: int) -> bool:
        return self.first <= e < self.first + self.count


def expert_shard(num_experts: int, what: str = "num_experts") -> ExpertShard | None:
    """This rank's experts under expert parallelism, None without it (every expert here, split
    by tensor parallelism if any). A ValueError naming ``what`` and both numbers when the
    experts do not divide over the ranks."""
    if not expert_parallel():
        return None
    n = tp_size()
    if num_experts % n:
        raise ValueError(f"{what} ({num_experts}) is not divisible by the expert-parallel size "
                         f"{n} (enable_expert_parallel places whole experts on each of the "
                         f"tensor_parallel_size {n} ranks)")
    count = num_experts // n
    return ExpertShard(num_experts, tp_rank() * count, count)


def shard_experts(param: torch.Tensor, shard: ExpertShard | None, dim: int = 0) -> None:
    """Mark a stacked expert parameter (built with this rank's ``count`` experts along ``dim``)
    to load its experts out of the checkpoint's full stack."""
    if shard is None:
        return

    def loader(p: torch.Tensor, tensor: torch.Tensor, part: str | None) -> None:
        if tensor.shape[dim] != shard.total:
            raise ValueError(f"stacked experts: checkpoint holds {tensor.shape[dim]} experts, "
                             f"the model {shard.total}")
        p.data.copy_(tensor.narrow(dim, shard.first, shard.count))

    param.tp_loader = loader  # type: ignore[attr-defined]


ExpertFn = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


def routed_ep(x: torch.Tensor, top_idx: torch.Tensor, shard: ExpertShard, expert: ExpertFn,
              extra: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The routed experts' sum for every token under expert parallelism, the same bits on every
    rank and as one rank's ascending-expert ``index_add_``.

    ``x`` (T, H); ``top_idx`` (T, k) global expert ids (the same on every rank);
    ``expert(local_e, tokens, slots)`` -> the weighted contributions (n, H) in ``x.dtype`` of
    this rank's expert ``local_e`` for those tokens (its ``n`` routed (token, slot) pairs, in
    ascending token order). ``extra`` (T, H): a tensor-parallel partial sum (a shared expert)
    reduced in the same collective. Returns (routed sum (T, H), reduced ``extra`` or None).
    """
    t, k = top_idx.shape
    h = x.shape[1]
    buf = x.new_zeros(t, k + (extra is not None), h)
    if extra is not None:
        buf[:, k] = extra
    if t:
        flat = top_idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=shard.total).tolist()  # one host sync
        start = sum(counts[: shard.first])
        for le in range(shard.count):
            n = counts[shard.first + le]
            if n == 0:
                continue
            sel = order[start : start + n]
            start += n
            tok, slot = sel // k, sel % k
            buf[tok, slot] = expert(le, tok, slot)
    all_reduce(buf)  # each slot non-zero on one rank only: an exact gather
    out = torch.zeros_like(x)
    if t:
        # A token's k contributions in ascending expert order, added into zeros one by one.
        asc = top_idx.argsort(dim=1)
        parts = buf[:, :k].gather(1, asc[..., None].expand(t, k, h))
        for j in range(k):
            out.add_(parts[:, j])
    return out, (buf[:, k] if extra is not None else None)
