"""The one pool of physical blocks that every cache group draws from.

Invariants:

* Block 0 is the null block: never allocated, never freed, used to pad block tables.
* Every other block is in exactly one of two states: referenced (``ref_cnt > 0``, held by one
  or more requests) or free (``ref_cnt == 0``, in the free queue). A free block may still carry
  a prefix-cache hash; it stays reusable until it is handed out again, at which point the hash
  is dropped (eviction).
* The free queue is ordered by eviction priority: the front is evicted first. Blocks freed
  together are appended in the order the caller gives (callers free a request's blocks tail
  first, so the prefix's head survives longest). Removal from the middle (a prefix hit on a free
  block) is O(1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    # Prefix-cache key of this block when it holds a full, computed, cacheable page.
    block_hash: Hashable | None = None


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the pool needs at least 2 blocks (1 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # pinned forever
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached: dict[Hashable, Block] = {}
        self.num_evictions = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (includes cached-but-free blocks)."""
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_usable

    def lookup(self, block_hash: Hashable) -> Block | None:
        return self.cached.get(block_hash)

    # ------------------------------------------------------------------ mutations
    def allocate(self, n: int) -> list[Block]:
        """Take ``n`` blocks from the front of the free queue (evicting cached ones)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, only {len(self._free)} free")
        out = []
        for _ in range(n):
            bid, _ = self._free.popitem(last=False)
            blk = self.blocks[bid]
            if blk.block_hash is not None:
                self._evict(blk)
            blk.ref_cnt = 1
            out.append(blk)
        return out

    def touch(self, blocks: list[Block]) -> None:
        """Take one more reference on each block (prefix hit or fork)."""
        for blk in blocks:
            if blk.ref_cnt == 0:
                del self._free[blk.block_id]
            blk.ref_cnt += 1

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference from each block, in order; blocks reaching 0 join the free queue."""
        for blk in blocks:
            if blk is self.null_block:
                continue
            blk.ref_cnt -= 1
            assert blk.ref_cnt >= 0, f"block {blk.block_id} freed twice"
            if blk.ref_cnt == 0:
                self._free[blk.block_id] = None

    def free_to_front(self, blocks: list[Block]) -> None:
        """Free blocks that are worth nothing once released (evicted first)."""
        for blk in blocks:
            if blk is self.null_block:
                continue
            blk.ref_cnt -= 1
            assert blk.ref_cnt >= 0, f"block {blk.block_id} freed twice"
            if blk.ref_cnt == 0:
                self._free[blk.block_id] = None
                self._free.move_to_end(blk.block_id, last=False)

    def cache_block(self, blk: Block, block_hash: Hashable) -> None:
        """Register a full, computed block under its hash (first writer wins)."""
        if blk.block_hash is not None or block_hash in self.cached:
            return
        blk.block_hash = block_hash
        self.cached[block_hash] = blk

    def _evict(self, blk: Block) -> None:
        if self.cached.get(blk.block_hash) is blk:
            del self.cached[blk.block_hash]
        blk.block_hash = None
        self.num_evictions += 1

    def reset_prefix_cache(self) -> None:
        for blk in list(self.cached.values()):
            self._evict(blk)

    def check_whole(self) -> None:
        """Assert that no block is held: every usable block is in the free queue."""
        held = [b.block_id for b in self.blocks[1:] if b.ref_cnt != 0]
        assert not held, f"blocks still referenced: {held[:20]}"
        assert len(self._free) == self.num_usable, (len(self._free), self.num_usable)
