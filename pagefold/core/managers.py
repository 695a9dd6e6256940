"""Per-type cache policy: one manager per cache group, all drawing from the same BlockPool.

The coordinator (``KVCacheManager``) never asks what kind of layer a group serves; it asks each
manager how many blocks a request needs to reach ``num_tokens`` computed tokens, then tells it
to allocate. New kinds of layer state get a new subclass here, not a branch in the scheduler.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from pagefold.core.block_pool import Block, BlockPool
from pagefold.core.kv_cache_planner import CacheGroup
from pagefold.core.kv_cache_spec import SlidingWindowSpec, cdiv


class GroupManager(ABC):
    def __init__(self, pool: BlockPool, group: CacheGroup, block_size: int) -> None:
        self.pool = pool
        self.group = group
        self.block_size = block_size
        self.req_blocks: dict[str, list[Block]] = {}

    @abstractmethod
    def num_blocks_needed(self, req_id: str, num_computed: int, num_tokens: int) -> int:
        """New blocks required so that tokens ``[num_computed, num_tokens)`` can be computed."""

    @abstractmethod
    def allocate(self, req_id: str, num_computed: int, num_tokens: int) -> None:
        """Allocate what ``num_blocks_needed`` promised (the caller checked the pool has them)."""

    def num_blocks_to_free(self, req_id: str, num_computed: int) -> int:
        """Blocks that ``allocate`` would return to the pool first (sliding window)."""
        return 0

    def free(self, req_id: str) -> None:
        blocks = self.req_blocks.pop(req_id, None)
        if blocks:
            # Tail first, so the head of a prefix stays cached longest.
            self.pool.free(list(reversed(blocks)))

    def block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(req_id, ())]

    def num_held(self, req_id: str) -> int:
        return sum(1 for b in self.req_blocks.get(req_id, ()) if b is not self.pool.null_block)


class FullAttentionManager(GroupManager):
    """One block per ``block_size`` tokens, allocated as the sequence grows."""

    def num_blocks_needed(self, req_id: str, num_computed: int, num_tokens: int) -> int:
        have = len(self.req_blocks.get(req_id, ()))
        return max(0, cdiv(num_tokens, self.block_size) - have)

    def allocate(self, req_id: str, num_computed: int, num_tokens: int) -> None:
        n = self.num_blocks_needed(req_id, num_computed, num_tokens)
        blocks = self.req_blocks.setdefault(req_id, [])
        if n:
            blocks.extend(self.pool.allocate(n))


class SlidingWindowManager(FullAttentionManager):
    """Like full attention, but blocks wholly outside the window go back to the pool.

    A query at position ``p`` reads keys ``(p - window, p]``; the earliest query of the next
    step is ``num_computed``, so blocks ending at or before ``num_computed - window + 1`` are
    dead. Their table slots become the null block so logical indices stay stable.
    """

    def _dead_prefix(self, num_computed: int) -> int:
        window = self.group.spec.window  # type: ignore[union-attr]
        first_needed = max(0, num_computed - window + 1)
        return first_needed // self.block_size

    def num_blocks_to_free(self, req_id: str, num_computed: int) -> int:
        blocks = self.req_blocks.get(req_id, ())
        dead = self._dead_prefix(num_computed)
        return sum(1 for b in blocks[:dead] if b is not self.pool.null_block)

    def allocate(self, req_id: str, num_computed: int, num_tokens: int) -> None:
        blocks = self.req_blocks.setdefault(req_id, [])
        dead = min(self._dead_prefix(num_computed), len(blocks))
        stale = [b for b in blocks[:dead] if b is not self.pool.null_block]
        if stale:
            self.pool.free(list(reversed(stale)))
            for i in range(dead):
                blocks[i] = self.pool.null_block
        super().allocate(req_id, num_computed, num_tokens)


class StateManager(GroupManager):
    """A fixed state per sequence: ``pages_per_state`` pages, taken at admission."""

    def num_blocks_needed(self, req_id: str, num_computed: int, num_tokens: int) -> int:
        return 0 if req_id in self.req_blocks else self.group.pages_per_state

    def allocate(self, req_id: str, num_computed: int, num_tokens: int) -> None:
        if req_id not in self.req_blocks:
            self.req_blocks[req_id] = self.pool.allocate(self.group.pages_per_state)


MANAGER_BY_KIND: dict[str, type[GroupManager]] = {
    "full_attention": FullAttentionManager,
    "sliding_window": SlidingWindowManager,
    "state": StateManager,
}


def make_manager(pool: BlockPool, group: CacheGroup, block_size: int) -> GroupManager:
    kind = group.spec.manager_kind
    if isinstance(group.spec, SlidingWindowSpec):
        kind = "sliding_window"
    return MANAGER_BY_KIND[kind](pool, group, block_size)
