"""Preemption by swap: a preempted request's pages move to a host-memory pool and come back.

The host pool mirrors the device pool's geometry (``layers_per_group`` tensors of
``num_host_blocks x page_bytes``), so a swap is a row copy per shared tensor. Every kind of
page (attention KV, state) swaps the same way: the state is just bytes in pages.

Swap or recompute is chosen per request by cost: moving ``bytes`` out and back over the host
link vs recomputing the tokens a prefix hit would not give back. A hybrid's long prompt (many
tokens, a fixed few-MiB state) favours swap; a short dense request favours recompute.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SwapOp:
    """Copy rows between the device pool and the host pool, for every layer of ``group``."""

    group: int
    device: list[int]
    host: list[int]
    to_host: bool


@dataclass(slots=True)
class SwappedRequest:
    """Where a swapped-out request's pages wait: per group, host rows (None = null block)."""

    host_blocks: list[list[int | None]]
    num_bytes: int


@dataclass
class SwapStats:
    swaps_out: int = 0
    swaps_in: int = 0
    bytes_out: int = 0
    bytes_in: int = 0


class HostPool:
    """Free-list allocator of host rows (no sharing, no caching: a parking lot)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"host pool: asked for {n} blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, ids: list[int]) -> None:
        self._free.extend(ids)

    def check_whole(self) -> None:
        assert len(self._free) == self.num_blocks and len(set(self._free)) == self.num_blocks, \
            "host pool blocks still held"


@dataclass(frozen=True)
class PreemptionCost:
    """Seconds-per-unit constants of the choice (defaults: a CPU-class host link).

    ``flops_per_token``: about 2 x parameters. ``compute_rate``: sustained FLOP/s of prefill.
    ``link_bandwidth``: bytes/s between the device pool and the host pool.
    """

    flops_per_token: float
    compute_rate: float = 5e10
    link_bandwidth: float = 1e10

    def recompute_seconds(self, tokens: int) -> float:
        return tokens * self.flops_per_token / self.compute_rate

    def swap_seconds(self, num_bytes: int) -> float:
        return 2 * num_bytes / self.link_bandwidth


@dataclass
class PreemptionLog:
    recompute: int = 0
    swap: int = 0
    recomputed_tokens: int = 0  # tokens requeued for recompute
    credited_tokens: int = 0  # of those, expected back from prefix cache and checkpoints
    decisions: list[tuple[str, str, int, int]] = field(default_factory=list)


def swap_out_pages(managers: list, pool, host: HostPool, req_id: str
                   ) -> tuple[list[list[int | None]], list[SwapOp]]:
    """Move ``req_id``'s pages of every group (``core.managers.GroupManager``) to host rows:
    the rows per group (None for a null block) and the copies out; its blocks are freed."""
    host_lists, ops = [], []
    for m in managers:
        blocks = m.req_blocks.get(req_id, [])
        real = [b for b in blocks if b is not pool.null_block]
        rows = iter(host.allocate(len(real)))
        hl = [None if b is pool.null_block else next(rows) for b in blocks]
        host_lists.append(hl)
        if real:
            ops.append(SwapOp(m.index, [b.block_id for b in real],
                              [h for h in hl if h is not None], to_host=True))
        if blocks:
            pool.free(list(reversed(m.req_blocks.pop(req_id))))
    return host_lists, ops


def swap_in_pages(managers: list, pool, host: HostPool, req_id: str,
                  host_lists: list[list[int | None]], start: int, end: int,
                  copies: list) -> list[SwapOp] | None:
    """Bring ``req_id``'s pages back from ``host_lists`` and grow them for tokens
    ``[start, end)`` (page copies the growth implies go to ``copies``); None, touching
    nothing, when the pool cannot hold them."""
    need = 0
    for m, hl in zip(managers, host_lists):
        need += sum(h is not None for h in hl)
        # Ask the policy about growth with a table of the swapped length (null stand-ins).
        m.req_blocks[req_id] = [pool.null_block] * len(hl)
        need += m.num_blocks_needed(req_id, start, end)
        del m.req_blocks[req_id]
    if need > pool.num_free:
        return None
    ops = []
    for m, hl in zip(managers, host_lists):
        rows = [h for h in hl if h is not None]
        dev = iter(pool.allocate(len(rows)))
        m.req_blocks[req_id] = [pool.null_block if h is None else next(dev) for h in hl]
        if rows:
            real = [b.block_id for b in m.req_blocks[req_id] if b is not pool.null_block]
            ops.append(SwapOp(m.index, real, rows, to_host=False))
            host.free(rows)  # the copy back is queued before any later swap-out
        m.allocate(req_id, start, end, copies)
    return ops
