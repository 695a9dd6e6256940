"""The staging reserve (``core/capture_staging.py``) on a real pool with a stand-in connector
that records what it is asked: how many sets are reserved, when a set is handed out, and
its way back (captured -> queued -> in flight -> free). Expectations from the module's
documented rules (sets per state group: at most 8 and at most 1/16 of the pool, at least 1)."""

from __future__ import annotations

import pytest

from pagefold.core.block_pool import BlockPool
from pagefold.core.capture_staging import CaptureStaging


class Connector:
    """Stores keys it saved; wants every key except those in ``unwanted``."""

    def __init__(self, stored=(), unwanted=()):
        self.stored, self.unwanted, self.saves = set(stored), set(unwanted), []

    def contains(self, key):
        return key in self.stored

    def wants(self, key):
        return key is not None and key not in self.unwanted

    def record_save(self, key, group, rows, num_tokens):
        self.saves.append((key, group, rows, num_tokens))


@pytest.mark.parametrize("usable, sets", [
    (2000, 8),  # 2000 // (16 * 5) = 25 -> at most 8
    (400, 5),  # 400 // 80
    (79, 1),  # 0 -> at least 1
    (160, 2),
])
def test_the_reserve_holds_sets_per_group_within_a_sixteenth_of_the_pool(usable, sets):
    pool = BlockPool(usable + 1)
    st = CaptureStaging(pool, Connector(), [2, 3])  # two state groups: 5 pages a set pair
    assert st.num_blocks == 5 * sets
    assert len(pool.reserved) == 5 * sets and pool.num_usable == usable - 5 * sets
    assert [len(st.take(("k", i), 2)) for i in range(sets)] == [2] * sets
    assert st.take(("k", "more"), 2) is None  # every 2-page set is out
    assert st.take(("k", 0), 3) is not None and st.take(("k", 0), 4) is None


def test_a_set_is_refused_for_a_key_stored_or_unwanted():
    conn = Connector(stored={"old"}, unwanted={"no"})
    st = CaptureStaging(BlockPool(100), conn, [2])
    assert st.take("old", 2) is None
    assert st.take("no", 2) is None
    assert st.take("new", 2) is not None


def test_a_captured_set_comes_back_after_the_step_that_carried_its_save():
    conn = Connector()
    st = CaptureStaging(BlockPool(17), conn, [2])  # 16 usable: 1 set
    blocks = st.take("a", 2)
    st.captured("a", 1, blocks, 64)
    assert conn.saves == [("a", 1, [b.block_id for b in blocks], 64)] and st.staged == 1
    assert st.take("b", 2) is None  # queued
    with pytest.raises(AssertionError, match="^staged checkpoint saves pending$"):
        st.check_idle()
    st.step_sent()
    assert st.take("b", 2) is None  # in flight
    with pytest.raises(AssertionError, match="^staged checkpoint saves pending$"):
        st.check_idle()
    st.step_done()
    st.check_idle()
    again = st.take("b", 2)
    assert again == blocks
    st.captured("b", 1, again, 32)
    st.step_sent()
    st.step_done()
    assert st.staged == 2 and st.take("c", 2) == blocks
    with pytest.raises(AssertionError, match="^a staging set is missing$"):
        st.check_idle()
    st.give_back(blocks)  # its capture did not happen
    st.check_idle()
