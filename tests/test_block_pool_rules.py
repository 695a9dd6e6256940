"""``core/block_pool.py`` and ``core/prefix_cache.py`` rules on a hand-built pool (no model):
allocation order, what touching blocks would cost, first-writer-wins caching, lazy deletion
from the eviction heap, the eviction count, the whole-pool check's message, and the block-hash
chain recomputed in the test with ``hashlib`` (written for mutmut's survivors once their
timeouts were re-run on one thread, see docs/TESTING.md)."""

from __future__ import annotations

import hashlib
import re
import struct
from types import SimpleNamespace as NS

import pytest

from pagefold.core.block_pool import BlockPool
from pagefold.core.prefix_cache import root_hash, update_block_hashes


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_plain_blocks_are_handed_out_oldest_first() -> None:
    pool = BlockPool(5)  # block 0 is the null block
    assert _ids(pool.allocate(2)) == [1, 2]
    assert _ids(pool.allocate(1)) == [3]


def test_free_cost_counts_what_a_touch_takes_out_of_the_free_pool() -> None:
    pool = BlockPool(8)
    b1, b2, b3 = pool.allocate(3)
    pool.free([b1, b2])  # 1, 2: plain free; 3: held
    b4, b5 = pool.allocate(2)
    assert (b4.block_id, b5.block_id) == (4, 5)
    assert pool.cache("E", [b4, b5], 32)
    pool.free([b4, b5])  # E: cached, nobody holds it, evictable
    b6, b7 = pool.allocate(2)
    assert pool.cache("H", [b6, b7], 32)  # H: cached and held
    # 1 + 1 (plain) + 0 (held) + 2 (E, counted once for its two blocks) + 0 (H held).
    assert pool.free_cost([b1, b2, b3, b4, b5, b6]) == 4
    assert pool.free_cost([b5, b4]) == 2
    assert pool.free_cost([b3, b6, b7]) == 0


def test_caching_is_first_writer_wins() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache("k", [a], 16) is True
    assert pool.cache("k", [b], 16) is False  # the key is taken
    assert pool.cache("other", [a], 16) is False  # the block already belongs to an entry
    assert pool.lookup("k") is a and pool.lookup("other") is None


def test_a_stale_heap_entry_never_evicts_a_re_released_entry() -> None:
    # Each release pushes the entry again; a touch makes its older pushes stale. At tick 3,
    # A (released at tick 3) is newer than B (tick 2): B is the one to go.
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.cache("A", [a], 1)
    pool.free([a])  # pushed at score 0 + 1
    pool.tick = 1
    pool.touch([a])
    pool.free([a])  # pushed at score 1 + 1
    pool.tick = 2
    (b,) = pool.allocate(1)
    pool.cache("B", [b], 1)
    pool.free([b])  # pushed at score 2 + 1
    pool.tick = 3
    pool.touch([a])
    pool.free([a])  # pushed at score 3 + 1
    assert _ids(pool.allocate(1)) == [b.block_id]
    assert pool.lookup("A") is a and pool.lookup("B") is None
    assert pool.num_evictions == 1
    pool.free([b])
    pool.allocate(2)  # evicts A too
    assert pool.num_evictions == 2


def test_check_whole_names_the_held_blocks() -> None:
    pool = BlockPool(3)
    held = pool.allocate(1)
    with pytest.raises(AssertionError, match=r"^blocks still referenced: \[1\]$"):
        pool.check_whole()
    pool.free(held)
    pool.check_whole()
    big = BlockPool(23)
    big.allocate(21)
    listed = str(list(range(1, 21)))  # the first 20 of the 21 held
    with pytest.raises(AssertionError, match=f"^blocks still referenced: {re.escape(listed)}$"):
        big.check_whole()


def _ref_hash(parent: bytes, tokens: list[int], images: list[str] = ()) -> bytes:
    """The module docstring's chain: sha256(parent || int64 tokens || image hashes)[:16]."""
    h = hashlib.sha256(parent + struct.pack(f"={len(tokens)}q", *tokens))
    for m in images:
        h.update(m.encode())
    return h.digest()[:16]


class _Images:
    """Placeholder runs ``(offset, length, content hash)``; ``hashes_in`` as documented in
    ``multimodal.inputs``: the images with a placeholder token in ``[start, end)``."""

    def __init__(self, runs) -> None:
        self.runs = runs

    def hashes_in(self, start: int, end: int) -> list[str]:
        return [h for off, n, h in self.runs if off < end and start < off + n]


def test_block_hashes_chain_with_salt_and_images() -> None:
    root = b"\x00" * 16
    assert root_hash() == root and root_hash(()) == root
    salted = hashlib.sha256(repr(("salt",)).encode()).digest()[:16]
    assert root_hash(("salt",)) == salted and len(salted) == 16
    assert root_hash(("salt",)) != root_hash(("pepper",))
    toks = list(range(100, 111))  # 11 tokens: two full blocks of 4, 3 left over
    req = NS(block_hashes=[], all_token_ids=toks, extra_keys=("salt",),
             mm_inputs=_Images([(2, 4, "imgA"), (9, 1, "imgB")]))
    h0 = _ref_hash(salted, toks[0:4], ["imgA"])
    h1 = _ref_hash(h0, toks[4:8], ["imgA"])
    assert update_block_hashes(req, 4) == [h0, h1] and req.block_hashes == [h0, h1]
    assert {len(h) for h in (h0, h1)} == {16}
    req.all_token_ids = toks + [111]  # the third block fills: imgB at 9
    assert update_block_hashes(req, 4) == [h0, h1, _ref_hash(h1, toks[8:] + [111], ["imgB"])]
    plain = NS(block_hashes=[], all_token_ids=toks, extra_keys=(), mm_inputs=None)
    assert update_block_hashes(plain, 4) == [
        _ref_hash(root, toks[0:4]), _ref_hash(_ref_hash(root, toks[0:4]), toks[4:8])]
