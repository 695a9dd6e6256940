"""Coordinates the per-group managers over one BlockPool: all-or-nothing allocation."""

from __future__ import annotations

from pagefold.core.block_pool import BlockPool
from pagefold.core.kv_cache_planner import KVCacheConfig
from pagefold.core.managers import GroupManager, make_manager
from pagefold.request import Request


class KVCacheManager:
    def __init__(self, config: KVCacheConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.pool = BlockPool(config.num_blocks)
        self.managers: list[GroupManager] = [
            make_manager(self.pool, g, config.block_size) for g in config.groups
        ]

    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        """Net blocks the pool must supply to compute ``num_new_tokens`` more tokens."""
        end = req.num_computed_tokens + num_new_tokens
        need = 0
        for m in self.managers:
            need += m.num_blocks_needed(req.request_id, req.num_computed_tokens, end)
            need -= m.num_blocks_to_free(req.request_id, req.num_computed_tokens)
        return need

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Give ``req`` every block it needs for ``num_new_tokens`` more tokens, or nothing."""
        if self.blocks_needed(req, num_new_tokens) > self.pool.num_free:
            return False
        end = req.num_computed_tokens + num_new_tokens
        for m in self.managers:
            m.allocate(req.request_id, req.num_computed_tokens, end)
        return True

    def free(self, req: Request) -> None:
        for m in self.managers:
            m.free(req.request_id)

    def block_ids(self, req_id: str) -> list[list[int]]:
        return [m.block_ids(req_id) for m in self.managers]

    def min_blocks_for(self, num_tokens: int) -> int:
        """Blocks one fresh request of ``num_tokens`` tokens needs (admission sanity check)."""
        return sum(m.num_blocks_needed("\0probe", 0, num_tokens) for m in self.managers)

    @property
    def usage(self) -> float:
        return self.pool.usage

    def check_whole(self) -> None:
        for m in self.managers:
            assert not m.req_blocks, f"requests still hold blocks: {list(m.req_blocks)[:10]}"
        self.pool.check_whole()
