"""The one pool of physical blocks that every cache group draws from.

Invariants:

* Block 0 is the null block: never allocated, never freed, used to pad block tables.
* Every other block is referenced (``ref_cnt > 0``, held by requests or pinned) or free. A free
  block is either *plain* (no cached content) or belongs to a cache *entry*: an attention block
  under its prefix hash, or the pages of a state checkpoint. Free cached blocks stay reusable
  until memory is needed; ``num_free`` counts them as free, so cached content never keeps a
  running request from being admitted.
* Allocation takes plain blocks first (oldest freed first), then evicts whole entries, lowest
  score first. An entry's score is the step it was last used plus the tokens it saves per
  page: eviction weighs compute saved per byte, not recency alone. A prefix hit on a free
  entry removes it from the eviction order in O(1) (lazy deletion from the heap).
* ``on_evict`` (a KV connector's save hook) sees every entry evicted to make room, before its
  blocks are handed out again; the blocks' bytes are unchanged until the step that the
  allocation serves runs, so a save queued for that step reads the evicted content.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    entry_key: Hashable | None = None  # the cache entry this block's content belongs to

    @property
    def block_hash(self) -> Hashable | None:
        return self.entry_key


@dataclass(slots=True)
class CacheEntry:
    key: Hashable
    blocks: list[Block]
    saved_tokens: int  # prefill tokens a hit on this entry skips
    last_used: int = 0
    num_hits: int = 0
    version: int = 0  # bumps when the entry leaves the eviction heap (lazy deletion)
    evictable: bool = False
    is_checkpoint: bool = False

    @property
    def score(self) -> float:
        return self.last_used + self.saved_tokens / len(self.blocks)


@dataclass
class PoolStats:
    evictions: int = 0
    checkpoints_saved: int = 0
    checkpoint_hits: int = 0
    extra: dict = field(default_factory=dict)


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"the pool needs at least 2 blocks (1 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # pinned forever
        self._plain: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.entries: dict[Hashable, CacheEntry] = {}
        self._heap: list[tuple[float, int, int, Hashable]] = []
        self._seq = 0
        self._evictable_blocks = 0
        self.tick = 0  # advanced once per engine step
        self.stats = PoolStats()
        self.on_evict: Callable[[CacheEntry], None] | None = None
        # Blocks taken for good by their owner (checkpoint staging pages): not usable.
        self.reserved: frozenset[int] = frozenset()

    def reserve(self, n: int) -> list[Block]:
        """Take ``n`` blocks out of the usable pool for good (before any request runs)."""
        blocks = self.allocate(n)
        self.reserved = self.reserved | {b.block_id for b in blocks}
        return blocks

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (plain free + evictable cached)."""
        return len(self._plain) + self._evictable_blocks

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1 - len(self.reserved)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_usable

    @property
    def num_evictions(self) -> int:
        return self.stats.evictions

    def lookup(self, key: Hashable) -> Block | None:
        e = self.entries.get(key)
        return e.blocks[0] if e is not None else None

    def entry(self, key: Hashable) -> CacheEntry | None:
        return self.entries.get(key)

    def checkpoint_stats(self) -> tuple[int, int]:
        """(number of state checkpoints cached, blocks they occupy)."""
        ck = [e for e in self.entries.values() if e.is_checkpoint]
        return len(ck), sum(len(e.blocks) for e in ck)

    def free_cost(self, blocks: list[Block]) -> int:
        """How many of ``blocks`` would stop being free if touched (to check before a hit)."""
        seen, n = set(), 0
        for b in blocks:
            if b.ref_cnt == 0 and b.entry_key is not None and b.entry_key not in seen:
                e = self.entries[b.entry_key]
                if e.evictable:
                    seen.add(b.entry_key)
                    n += len(e.blocks)
            elif b.ref_cnt == 0 and b.block_id in self._plain:
                n += 1
        return n

    # ------------------------------------------------------------------ allocation
    def allocate(self, n: int) -> list[Block]:
        """Take ``n`` blocks: plain free ones first, then by evicting the lowest-score entries."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} blocks, only {self.num_free} free")
        while len(self._plain) < n:
            self._evict_one()
        out = []
        for _ in range(n):
            bid, _ = self._plain.popitem(last=False)
            blk = self.blocks[bid]
            blk.ref_cnt = 1
            out.append(blk)
        return out

    def touch(self, blocks: list[Block]) -> None:
        """Take one more reference on each block (prefix hit, fork, pin)."""
        for blk in blocks:
            if blk.ref_cnt == 0:
                if blk.entry_key is None:
                    del self._plain[blk.block_id]
                else:
                    self._unmark_evictable(self.entries[blk.entry_key])
            blk.ref_cnt += 1

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference from each block, in order; released blocks become free.

        An entry becomes evictable once none of its blocks is held. References only drop
        here, so that moment is the last release of one of its blocks in this call: entries
        are checked once each, after the loop, in the order of their last release (a
        check per released block made freeing a P-page checkpoint O(P^2)).
        """
        released: dict[Hashable, None] = {}  # entry keys, ordered by their last release
        for blk in blocks:
            if blk is self.null_block:
                continue
            blk.ref_cnt -= 1
            assert blk.ref_cnt >= 0, f"block {blk.block_id} freed twice"
            if blk.ref_cnt == 0:
                if blk.entry_key is None:
                    self._plain[blk.block_id] = None
                else:
                    released.pop(blk.entry_key, None)
                    released[blk.entry_key] = None
        for key in released:
            e = self.entries[key]
            if all(b.ref_cnt == 0 for b in e.blocks):
                self._mark_evictable(e)

    # ------------------------------------------------------------------ cache entries
    def cache(self, key: Hashable, blocks: list[Block], saved_tokens: int,
              is_checkpoint: bool = False) -> bool:
        """Register held blocks' content under ``key`` (first writer wins). Returns success."""
        if key in self.entries:
            return False
        for b in blocks:  # plain loops: this runs once per full block of every prompt
            if b.entry_key is not None:
                return False
        e = CacheEntry(key, list(blocks), saved_tokens, last_used=self.tick,
                       is_checkpoint=is_checkpoint)
        self.entries[key] = e
        idle = True
        for b in blocks:
            b.entry_key = key
            idle = idle and b.ref_cnt == 0
        if idle:
            self._mark_evictable(e)
        if is_checkpoint:
            self.stats.checkpoints_saved += 1
        return True

    def cache_block(self, blk: Block, key: Hashable, saved_tokens: int = 1) -> None:
        self.cache(key, [blk], saved_tokens)

    def note_hit(self, key: Hashable) -> None:
        e = self.entries[key]
        e.last_used = self.tick
        e.num_hits += 1
        if e.is_checkpoint:
            self.stats.checkpoint_hits += 1

    def reset_prefix_cache(self) -> None:
        """Drop every cached entry whose blocks nobody holds."""
        for e in [e for e in self.entries.values() if e.evictable]:
            self._drop(e)

    def _mark_evictable(self, e: CacheEntry) -> None:
        e.evictable = True
        self._evictable_blocks += len(e.blocks)
        self._seq += 1
        heapq.heappush(self._heap, (e.score, self._seq, e.version, e.key))

    def _unmark_evictable(self, e: CacheEntry) -> None:
        if e.evictable:
            e.evictable = False
            e.version += 1
            self._evictable_blocks -= len(e.blocks)
            e.last_used = self.tick

    def _evict_one(self) -> None:
        while True:
            _, _, version, key = heapq.heappop(self._heap)
            e = self.entries.get(key)
            if e is not None and e.evictable and e.version == version:
                break
        if self.on_evict is not None:
            self.on_evict(e)
        self._drop(e)
        self.stats.evictions += 1

    def _drop(self, e: CacheEntry) -> None:
        """Forget an evictable entry: its blocks become plain free blocks."""
        del self.entries[e.key]
        e.evictable = False
        e.version += 1
        self._evictable_blocks -= len(e.blocks)
        for b in e.blocks:
            b.entry_key = None
            self._plain[b.block_id] = None

    def check_whole(self) -> None:
        """Assert that no block is held: every usable block is free (plain or cached)."""
        held = [b.block_id for b in self.blocks[1:] if b.ref_cnt != 0
                and b.block_id not in self.reserved]
        assert not held, f"blocks still referenced: {held[:20]}"
        assert self.num_free == self.num_usable, (self.num_free, self.num_usable)
