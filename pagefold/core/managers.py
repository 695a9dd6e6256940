"""Per-type cache policy: one manager per cache group, all drawing from the same BlockPool.

The coordinator (``KVCacheManager``) never asks what kind of layer a group serves. It asks each
manager: how many blocks does a request need to reach ``num_tokens`` computed tokens; which
prefix lengths can you serve from cache; where must a prefill chunk stop so you can save a
reusable state. New kinds of layer state are a new subclass here, not a branch in the scheduler.

Prefix-cache keys are ``(group index, block hash)`` for attention blocks and
``("ckpt", group index, block hash)`` for state checkpoints, so groups never share entries.

With a KV connector (``core/kv_connector.py``: offload tiers), a hit may also cover keys that
lie outside the pool (``stored(key)``): each kind decides what such a key costs and how it
comes back (``take_tier_hit``): an attention block is loaded into a fresh block that becomes
a cache entry once the load succeeded (``finish_tier_load``); a state checkpoint is loaded
straight into the request's own state pages.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from pagefold.core.block_pool import Block, BlockPool
from pagefold.core.kv_cache_planner import CacheGroup
from pagefold.core.kv_cache_spec import SlidingWindowSpec, cdiv, first_key

Stored = Callable[[Hashable], bool] | None
# (cache key, pool rows) to load for a request: the manager's answer to a tier hit.
TierLoads = list[tuple[Hashable, list[int]]]


@dataclass(slots=True)
class PageCopy:
    """Copy whole pages (same count) inside the pool, executed by the runner before a forward."""

    group: int
    src: list[int]
    dst: list[int]


@dataclass(frozen=True, slots=True)
class StateCapture:
    """Save a request's state after its first ``num_tokens`` tokens into ``pages``, from inside
    the step that computes that position (a checkpoint without ending the chunk there)."""

    request_id: str
    group: int
    num_tokens: int
    pages: list[int]


class GroupManager(ABC):
    def __init__(self, pool: BlockPool, group: CacheGroup, index: int, block_size: int) -> None:
        self.pool = pool
        self.group = group
        self.index = index
        self.block_size = block_size
        self.req_blocks: dict[str, list[Block]] = {}

    @abstractmethod
    def num_blocks_needed(self, req_id: str, num_computed: int, num_tokens: int) -> int:
        """New blocks required so that tokens ``[num_computed, num_tokens)`` can be computed."""

    @abstractmethod
    def allocate(self, req_id: str, num_computed: int, num_tokens: int,
                 copies: list[PageCopy] | None = None) -> None:
        """Allocate what ``num_blocks_needed`` promised (the caller checked the pool has them).

        Page copies the allocation implies (copy-on-write) are appended to ``copies``."""

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

    @abstractmethod
    def fork(self, parent_id: str, child_id: str) -> list[PageCopy]:
        """Give ``child_id`` the parent's cache as it stands (share or copy, per kind)."""

    def fork_cost(self, parent_id: str) -> int:
        """Blocks a fork takes from the pool now."""
        return 0

    # ---- prefix caching (defaults: this kind caches nothing) ----
    def hit_lengths(self, hashes: list[bytes], max_blocks: int, stored: Stored = None
                    ) -> set[int] | int:
        """Prefix lengths (in blocks) this group can serve: an int n means every length <= n.
        ``stored``: keys outside the pool that a connector can load count as cached."""
        return 0

    def hit_cost(self, hashes: list[bytes], n_blocks: int, stored: Stored = None) -> int:
        """Free blocks that taking a hit of ``n_blocks`` would consume (beyond new blocks)."""
        return 0

    def plan_capture(self, req_id: str, hashes: list[bytes], num_tokens: int,
                     staging_ok: bool = False) -> StateCapture | None:
        """Pages for a checkpoint at ``num_tokens`` that the coming step writes in its kernels
        (registered as a cache entry by ``after_step``); None: nothing to capture.
        ``staging_ok``: a short pool may use a staging set (``core/capture_staging.py``)."""
        return None

    def take_hit(self, req_id: str, hashes: list[bytes], n_blocks: int) -> list[PageCopy]:
        return []

    def take_tier_hit(self, req_id: str, hashes: list[bytes], n_blocks: int,
                      stored: Callable[[Hashable], bool]) -> tuple[list[PageCopy], TierLoads]:
        """Take a hit of ``n_blocks`` whose keys are in the pool or ``stored`` outside it:
        the page copies it implies and the loads to request (pool rows already allocated)."""
        return self.take_hit(req_id, hashes, n_blocks), []

    def tier_keys(self, hashes: list[bytes], n_blocks: int,
                  stored: Callable[[Hashable], bool]) -> list[Hashable]:
        """The keys ``take_tier_hit`` would load (pinned in the connector first, so the
        evictions its own allocations cause cannot push them out of a tier)."""
        return []

    def finish_tier_load(self, req_id: str, failed: set[Hashable]) -> None:  # noqa: B027
        """The loads of ``take_tier_hit`` ran; ``failed`` keys never reached the pool
        (default: nothing to register)."""

    def hit_blocks(self, hashes: list[bytes], n_blocks: int, stored: Stored = None
                   ) -> list[Block]:
        """The cached blocks a hit of ``n_blocks`` reads (pinned before any group allocates,
        so one group's allocation cannot evict what another group's hit is about to use)."""
        return []

    def after_step(self, req_id: str, hashes: list[bytes], num_computed: int,
                   is_checkpoint_target: bool) -> list[PageCopy]:
        """Cache what became reusable once ``num_computed`` tokens are computed."""
        return []

    def wants_checkpoints(self) -> bool:
        return False

    def take_tail(self, req_id: str, key: Hashable) -> TierLoads:
        """A consumer's prompt tail (``core/prompt_tail.py``) under ``key``: the pages of the
        request it is loaded into (allocated here; the caller checked the pool has them)."""
        return []

    def tail_block_ids(self, req_id: str) -> list[int]:
        """A producer's prompt-tail pages held for ``req_id`` (state groups; empty: none)."""
        return []


class FullAttentionManager(GroupManager):
    """One block per ``block_size`` tokens, allocated as the sequence grows; hash-chained.

    Blocks are append-only, so forks share them by reference count. Before a request writes
    into a partly filled block that another request also holds, it gets its own copy
    (copy-on-write of that one block).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Blocks being loaded from outside the pool for a request: (cache key, block).
        self.loading: dict[str, list[tuple[Hashable, Block]]] = {}

    def _needs_cow(self, req_id: str, num_computed: int) -> bool:
        blocks = self.req_blocks.get(req_id)
        i = num_computed // self.block_size
        return bool(blocks) and num_computed % self.block_size != 0 and i < len(blocks) \
            and blocks[i].ref_cnt > 1

    def num_blocks_needed(self, req_id: str, num_computed: int, num_tokens: int) -> int:
        have = len(self.req_blocks.get(req_id, ()))
        cow = 1 if num_tokens > num_computed and self._needs_cow(req_id, num_computed) else 0
        return max(0, cdiv(num_tokens, self.block_size) - have) + cow

    def allocate(self, req_id: str, num_computed: int, num_tokens: int,
                 copies: list[PageCopy] | None = None) -> None:
        blocks = self.req_blocks.setdefault(req_id, [])
        if num_tokens > num_computed and self._needs_cow(req_id, num_computed):
            i = num_computed // self.block_size
            shared = blocks[i]
            (own,) = self.pool.allocate(1)
            if copies is not None:
                copies.append(PageCopy(self.index, [shared.block_id], [own.block_id]))
            blocks[i] = own
            self.pool.free([shared])
        n = max(0, cdiv(num_tokens, self.block_size) - len(blocks))
        if n:
            blocks.extend(self.pool.allocate(n))

    def fork(self, parent_id: str, child_id: str) -> list[PageCopy]:
        blocks = list(self.req_blocks.get(parent_id, ()))
        self.pool.touch([b for b in blocks if b is not self.pool.null_block])
        self.req_blocks[child_id] = blocks
        return []

    def _key(self, h: bytes):
        return (self.index, h)

    def _cached_prefix(self, hashes: list[bytes], max_blocks: int) -> list[Block]:
        out = []
        for h in hashes[:max_blocks]:
            blk = self.pool.lookup(self._key(h))
            if blk is None:
                break
            out.append(blk)
        return out

    def _servable_prefix(self, hashes: list[bytes], max_blocks: int, stored: Stored
                         ) -> list[Block | None]:
        """The longest prefix whose every block is cached in the pool (its Block) or stored
        outside it (None)."""
        if stored is None:
            return self._cached_prefix(hashes, max_blocks)  # type: ignore[return-value]
        out: list[Block | None] = []
        for h in hashes[:max_blocks]:
            key = self._key(h)
            blk = self.pool.lookup(key)
            if blk is None and not stored(key):
                break
            out.append(blk)
        return out

    def hit_lengths(self, hashes: list[bytes], max_blocks: int, stored: Stored = None) -> int:
        return len(self._servable_prefix(hashes, max_blocks, stored))

    def hit_cost(self, hashes: list[bytes], n_blocks: int, stored: Stored = None) -> int:
        blocks = self._servable_prefix(hashes, n_blocks, stored)
        held = [b for b in blocks if b is not None]
        return self.pool.free_cost(held) + len(blocks) - len(held)  # + fresh blocks to load

    def hit_blocks(self, hashes: list[bytes], n_blocks: int, stored: Stored = None
                   ) -> list[Block]:
        return [b for b in self._servable_prefix(hashes, n_blocks, stored) if b is not None]

    def take_hit(self, req_id: str, hashes: list[bytes], n_blocks: int) -> list[PageCopy]:
        blocks = self._cached_prefix(hashes, n_blocks)
        assert len(blocks) == n_blocks and req_id not in self.req_blocks
        self.pool.touch(blocks)
        for h in hashes[:n_blocks]:
            self.pool.note_hit(self._key(h))
        self.req_blocks[req_id] = list(blocks)
        return []

    def take_tier_hit(self, req_id: str, hashes: list[bytes], n_blocks: int,
                      stored: Callable[[Hashable], bool]) -> tuple[list[PageCopy], TierLoads]:
        blocks = self._servable_prefix(hashes, n_blocks, stored)
        assert len(blocks) == n_blocks and req_id not in self.req_blocks
        held = [b for b in blocks if b is not None]
        self.pool.touch(held)
        for h, b in zip(hashes, blocks):
            if b is not None:
                self.pool.note_hit(self._key(h))
        loads: TierLoads = []
        pending = []
        for i, b in enumerate(blocks):
            if b is None:  # outside the pool: a fresh block, cached once its load succeeded
                (b,) = self.pool.allocate(1)
                blocks[i] = b
                key = self._key(hashes[i])
                loads.append((key, [b.block_id]))
                pending.append((key, b))
        if pending:
            self.loading[req_id] = pending
        self.req_blocks[req_id] = blocks  # type: ignore[assignment]
        return [], loads

    def tier_keys(self, hashes: list[bytes], n_blocks: int,
                  stored: Callable[[Hashable], bool]) -> list[Hashable]:
        blocks = self._servable_prefix(hashes, n_blocks, stored)
        return [self._key(h) for h, b in zip(hashes, blocks) if b is None]

    def finish_tier_load(self, req_id: str, failed: set[Hashable]) -> None:
        for key, blk in self.loading.pop(req_id, ()):
            if key not in failed and blk.entry_key is None:
                self.pool.cache(key, [blk], self.block_size)

    def free(self, req_id: str) -> None:
        self.loading.pop(req_id, None)
        super().free(req_id)

    def take_tail(self, req_id: str, key: Hashable) -> TierLoads:
        # The partial block after the hit's full blocks: the request's own, never cached.
        (b,) = self.pool.allocate(1)
        self.req_blocks.setdefault(req_id, []).append(b)
        return [(key, [b.block_id])]

    def after_step(self, req_id: str, hashes: list[bytes], num_computed: int,
                   is_checkpoint_target: bool) -> list[PageCopy]:
        blocks = self.req_blocks.get(req_id, [])
        full = min(num_computed // self.block_size, len(hashes), len(blocks))
        # Walk back from the newest full block; stop at the first already-cached one.
        for i in range(full - 1, -1, -1):
            blk = blocks[i]
            if blk is self.pool.null_block or blk.entry_key is not None:
                break
            self.pool.cache(self._key(hashes[i]), [blk], self.block_size)
        return []


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
        # A dead block shared with a fork stays held by the other request: it frees nothing.
        return sum(1 for b in blocks[:dead] if b is not self.pool.null_block and b.ref_cnt == 1)

    def allocate(self, req_id: str, num_computed: int, num_tokens: int,
                 copies: list[PageCopy] | None = None) -> None:
        blocks = self.req_blocks.setdefault(req_id, [])
        dead = min(self._dead_prefix(num_computed), len(blocks))
        stale = [b for b in blocks[:dead] if b is not self.pool.null_block]
        if stale:
            self.pool.free(list(reversed(stale)))
            for i in range(dead):
                blocks[i] = self.pool.null_block
        super().allocate(req_id, num_computed, num_tokens, copies)


class ChunkedLocalManager(SlidingWindowManager):
    """Chunked local attention: a query reads keys from its chunk's start on, so blocks that
    end before the chunk of the next step's earliest query (``num_computed``) are dead; they
    become the null block like a sliding window's."""

    def _dead_prefix(self, num_computed: int) -> int:
        return first_key(self.group.spec, num_computed) // self.block_size


class StateManager(GroupManager):
    """A fixed state per sequence: ``pages_per_state`` pages, taken at admission.

    With prefix caching, the state at an exact prefix length P (a multiple of the block size)
    can be saved as a *checkpoint*: a copy of the pages, cached under the prefix hash at P. A
    hit restores it by copying into the request's own pages (states are overwritten in place,
    so they are never shared). A running request holds a reference on its own newest
    checkpoint, so memory pressure cannot evict it before the request ends or is preempted:
    a preempted request resumes from it (recompute with credit), a finished one leaves it for
    the next conversation turn.

    A producer's prompt tail (``core/prompt_tail.py``: the state after all but the last
    prompt token, not a block boundary) is held in ``tail`` pages of its own, never a cache
    entry, until the request is freed.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.own_checkpoint: dict[str, list[Block]] = {}
        self.tail: dict[str, list[Block]] = {}
        # Captures planned for the running step: (num_tokens, cache key, pages held, staged).
        self.pending: dict[str, list[tuple[int, tuple, list[Block], bool]]] = {}
        # Offload tiers: page sets for captures the pool has no room for (``CaptureStaging``:
        # take / give_back / captured), or None.
        self.staging = None

    def free(self, req_id: str) -> None:
        super().free(req_id)
        own = self.own_checkpoint.pop(req_id, None)
        if own:
            self.pool.free(own)
        for _, _, dst, staged in self.pending.pop(req_id, ()):
            if staged:
                self.staging.give_back(dst)
            else:
                self.pool.free(dst)
        tail = self.tail.pop(req_id, None)
        if tail:
            self.pool.free(tail)

    def _take_tail_pages(self, req_id: str) -> list[Block] | None:
        pages = self.group.pages_per_state
        if req_id in self.tail or req_id not in self.req_blocks or self.pool.num_free < pages:
            return None
        self.tail[req_id] = dst = self.pool.allocate(pages)
        return dst

    def plan_tail(self, req_id: str, num_tokens: int) -> StateCapture | None:
        """Pages for the prompt tail's state after ``num_tokens`` tokens, written by the coming
        step's kernels; None: the pool is short (or a tail is held already)."""
        dst = self._take_tail_pages(req_id)
        if dst is None:
            return None
        return StateCapture(req_id, self.index, num_tokens, [b.block_id for b in dst])

    def copy_tail(self, req_id: str) -> list[PageCopy]:
        """The step that ended at the tail length ran: copy the state into tail pages (pinned
        until the copy ran: the caller releases that reference)."""
        dst = self._take_tail_pages(req_id)
        if dst is None:
            return []
        self.pool.touch(dst)
        return [PageCopy(self.index, self.block_ids(req_id), [b.block_id for b in dst])]

    def tail_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.tail.get(req_id, ())]

    def take_tail(self, req_id: str, key: Hashable) -> TierLoads:
        self.allocate(req_id, 0, 0)  # the tail state loads straight into the own pages
        return [(key, self.block_ids(req_id))]

    def _keep_as_own(self, req_id: str, dst: list[Block]) -> None:
        old = self.own_checkpoint.get(req_id)
        self.own_checkpoint[req_id] = dst
        if old:
            self.pool.free(old)

    def plan_capture(self, req_id: str, hashes: list[bytes], num_tokens: int,
                     staging_ok: bool = False) -> StateCapture | None:
        bs, pages = self.block_size, self.group.pages_per_state
        if num_tokens % bs or not 0 < num_tokens // bs <= len(hashes):
            return None
        key = self._key(hashes[num_tokens // bs - 1])
        if key in self.pool.entries or req_id not in self.req_blocks:
            return None
        staged = self.pool.num_free < pages
        if not staged:
            dst = self.pool.allocate(pages)  # held (ref 1) until after_step registers it
        elif not staging_ok or self.staging is None \
                or (dst := self.staging.take(key, pages)) is None:
            return None
        self.pending.setdefault(req_id, []).append((num_tokens, key, dst, staged))
        return StateCapture(req_id, self.index, num_tokens, [b.block_id for b in dst])

    def _register_captures(self, req_id: str) -> None:
        """The step ran: its captured checkpoints become cache entries (first writer wins),
        the newest one held by the request as its own; a staged one goes to the tiers."""
        for num_tokens, key, dst, staged in sorted(self.pending.pop(req_id, ()),
                                                   key=lambda p: p[0]):
            if staged:
                self.staging.captured(key, self.index, dst, num_tokens)
            elif self.pool.cache(key, dst, num_tokens, is_checkpoint=True):
                self._keep_as_own(req_id, dst)
            else:
                self.pool.free(dst)

    def num_blocks_needed(self, req_id: str, num_computed: int, num_tokens: int) -> int:
        return 0 if req_id in self.req_blocks else self.group.pages_per_state

    def allocate(self, req_id: str, num_computed: int, num_tokens: int,
                 copies: list[PageCopy] | None = None) -> None:
        if req_id not in self.req_blocks:
            self.req_blocks[req_id] = self.pool.allocate(self.group.pages_per_state)

    def fork(self, parent_id: str, child_id: str) -> list[PageCopy]:
        # A state is overwritten in place every step: a fork needs its own copy, eagerly.
        self.allocate(child_id, 0, 0)
        return [PageCopy(self.index, self.block_ids(parent_id), self.block_ids(child_id))]

    def fork_cost(self, parent_id: str) -> int:
        return self.group.pages_per_state

    def wants_checkpoints(self) -> bool:
        return True

    def _key(self, h: bytes):
        return ("ckpt", self.index, h)

    def hit_lengths(self, hashes: list[bytes], max_blocks: int, stored: Stored = None
                    ) -> set[int]:
        entries = self.pool.entries
        return {i + 1 for i, h in enumerate(hashes[:max_blocks])
                if (key := self._key(h)) in entries or (stored is not None and stored(key))}

    def hit_cost(self, hashes: list[bytes], n_blocks: int, stored: Stored = None) -> int:
        # The checkpoint is pinned until its copy runs; its pages stop counting as free. A
        # checkpoint outside the pool loads straight into the request's own pages (counted
        # by ``num_blocks_needed``).
        e = self.pool.entry(self._key(hashes[n_blocks - 1]))
        return len(e.blocks) if e is not None and e.evictable else 0

    def hit_blocks(self, hashes: list[bytes], n_blocks: int, stored: Stored = None
                   ) -> list[Block]:
        e = self.pool.entry(self._key(hashes[n_blocks - 1]))
        return list(e.blocks) if e is not None else []

    def take_hit(self, req_id: str, hashes: list[bytes], n_blocks: int) -> list[PageCopy]:
        key = self._key(hashes[n_blocks - 1])
        e = self.pool.entry(key)
        assert e is not None
        self.pool.touch(e.blocks)  # pinned; the coordinator unpins after the copy
        self.pool.note_hit(key)
        self.allocate(req_id, 0, 0)
        dst = self.block_ids(req_id)
        return [PageCopy(self.index, [b.block_id for b in e.blocks], dst)]

    def tier_keys(self, hashes: list[bytes], n_blocks: int,
                  stored: Callable[[Hashable], bool]) -> list[Hashable]:
        key = self._key(hashes[n_blocks - 1])
        return [] if key in self.pool.entries else [key]

    def take_tier_hit(self, req_id: str, hashes: list[bytes], n_blocks: int,
                      stored: Callable[[Hashable], bool]) -> tuple[list[PageCopy], TierLoads]:
        key = self._key(hashes[n_blocks - 1])
        if key in self.pool.entries:
            return self.take_hit(req_id, hashes, n_blocks), []
        # Outside the pool: loaded into the request's own state pages (never shared).
        self.allocate(req_id, 0, 0)
        return [], [(key, self.block_ids(req_id))]

    def after_step(self, req_id: str, hashes: list[bytes], num_computed: int,
                   is_checkpoint_target: bool) -> list[PageCopy]:
        self._register_captures(req_id)
        bs = self.block_size
        if not is_checkpoint_target or num_computed % bs or num_computed // bs > len(hashes):
            return []
        key = self._key(hashes[num_computed // bs - 1])
        pages = self.group.pages_per_state
        if key in self.pool.entries or self.pool.num_free < pages or req_id not in self.req_blocks:
            return []
        dst = self.pool.allocate(pages)  # pinned (ref 1) until the copy runs
        self.pool.cache(key, dst, num_computed, is_checkpoint=True)
        self.pool.touch(dst)  # ... and held by the request as its newest checkpoint
        self._keep_as_own(req_id, dst)
        return [PageCopy(self.index, self.block_ids(req_id), [b.block_id for b in dst])]


MANAGER_BY_KIND: dict[str, type[GroupManager]] = {
    "full_attention": FullAttentionManager,
    "sliding_window": SlidingWindowManager,
    "chunked_local": ChunkedLocalManager,
    "state": StateManager,
}


def make_manager(pool: BlockPool, group: CacheGroup, index: int, block_size: int) -> GroupManager:
    kind = group.spec.manager_kind
    if isinstance(group.spec, SlidingWindowSpec):
        kind = "sliding_window"
    return MANAGER_BY_KIND[kind](pool, group, index, block_size)
