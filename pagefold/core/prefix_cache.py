"""Block hashes for prefix caching: a chain over full blocks of token ids.

``hash(i) = sha256(hash(i-1) || tokens of block i || extra keys)[:16]``; block 0's parent is a
root derived from the request's extra keys (cache salt, adapter id). A block that holds image
placeholder tokens also takes those images' content hashes, since its placeholder ids are the
same for every image. A block's hash therefore names its whole prefix, images included.
sha256 makes collisions negligible, so a hit needs no token re-check.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from pagefold.request import Request

ROOT = b"\x00" * 16


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which served from cache (the pool or a KV connector)
    local_hits: int = 0  # of those, from the pool itself
    requests: int = 0
    requests_hit: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def root_hash(extra_keys: tuple = ()) -> bytes:
    if not extra_keys:
        return ROOT
    return hashlib.sha256(repr(extra_keys).encode()).digest()[:16]


def hash_block(parent: bytes, tokens: list[int], mm_hashes: list[str] = ()) -> bytes:
    """``mm_hashes``: content hashes of the images with a placeholder token in the block."""
    h = hashlib.sha256(parent)
    h.update(array("q", tokens).tobytes())
    for m in mm_hashes:
        h.update(m.encode())
    return h.digest()[:16]


def update_block_hashes(req: Request, block_size: int) -> list[bytes]:
    """Extend ``req.block_hashes`` over every full block of its known tokens; returns it."""
    hashes = req.block_hashes
    toks = req.all_token_ids
    parent = hashes[-1] if hashes else root_hash(req.extra_keys)
    while (len(hashes) + 1) * block_size <= len(toks):
        i = len(hashes)
        lo, hi = i * block_size, (i + 1) * block_size
        mm = req.mm_inputs.hashes_in(lo, hi) if req.mm_inputs is not None else ()
        parent = hash_block(parent, toks[lo:hi], mm)
        hashes.append(parent)
    return hashes
