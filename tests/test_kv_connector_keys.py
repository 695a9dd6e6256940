"""Page keys on the wire and a step's connector ops (``core/kv_connector.py``), by the
documented formats: ``a<group>-<hex>`` for an attention block ``(group, hash)``,
``s<group>-<hex>`` for a checkpoint ``("ckpt", group, hash)``, ``t<group>-<hex>`` for a prompt
tail; a step's ops are worth sending when any of them (or a poll / drain) is set, never
for ``idle`` or ``remotes`` alone."""

from __future__ import annotations

import pytest

from pagefold.core.kv_connector import KVOps, key_from_name, key_group, key_name

KEYS = [((2, b"\x01\xff"), "a2-01ff"), (("ckpt", 13, b"\xab"), "s13-ab"),
        (("tail", 0, b"\x00\x10"), "t0-0010")]


@pytest.mark.parametrize("key, name", KEYS)
def test_a_key_and_its_name_round_trip(key, name):
    assert key_name(key) == name
    assert key_from_name(name) == key
    assert key_group(key) == int(name[1:name.index("-")])


@pytest.mark.parametrize("bad", ["x1-00", "a1-", "a1", "-00", ""])
def test_a_malformed_name_is_refused(bad):
    with pytest.raises(ValueError, match=f"^not a page key name: {bad!r}$"):
        key_from_name(bad)


@pytest.mark.parametrize("field, value, sent", [
    ("drops", ["f"], True), ("saves", [object()], True), ("loads", [object()], True),
    ("cancels", ["r"], True), ("exports", [object()], True), ("releases", [object()], True),
    ("poll", True, True), ("drain", True, True), ("idle", True, False),
    ("remotes", [object()], False),
])
def test_ops_are_sent_when_any_work_is_set(field, value, sent):
    assert not KVOps()
    assert bool(KVOps(**{field: value})) is sent


def test_rank_reports_merge_counts_from_rank_0_bytes_summed_failures_united():
    """Two ranks' reports of one step: tier counts, pulls and pull time are rank 0's, bytes
    the sum, store failures and a request's failed keys the union (each once), and a request
    finishes when both ranks have finished it; a cancelled request's partial reports are
    dropped (its keys never reported)."""
    import torch

    from pagefold.core.kv_connector import ConnectorOutput, ReportMerger

    r0 = ConnectorOutput(finished=["a"], failed={"a": ["a0-01", "s1-02"]},
                         store_failed=["x", "y"], bytes_saved=5, pulls=2, pull_seconds=0.5)
    r0.count_load("host", torch.zeros(6, dtype=torch.uint8))
    r0.count_load("host", torch.zeros(4, dtype=torch.uint8))
    r0.count_load("disk", torch.zeros(1, dtype=torch.uint8))
    assert (r0.loaded_from, r0.bytes_loaded) == ({"host": 2, "disk": 1}, 11)
    r1 = ConnectorOutput(finished=["a", "c"], failed={"a": ["s1-02", "a0-03"], "c": ["t0-04"]},
                         store_failed=["y", "z"], loaded_from={"disk": 7}, bytes_loaded=3,
                         bytes_saved=4, pulls=9, pull_seconds=9.0)
    m = ReportMerger(2)
    out = m.merge([r0, r1], [])
    assert out.finished == ["a"] and out.failed == {"a": ["a0-01", "s1-02", "a0-03"]}
    assert out.store_failed == ["x", "y", "z"] and out.loaded_from == {"host": 2, "disk": 1}
    assert (out.bytes_loaded, out.bytes_saved, out.pulls, out.pull_seconds) == (14, 9, 2, 0.5)
    out = m.merge([None, None], ["c", "z"])  # c aborted (rank 0 never finishes it); z unseen
    out = m.merge([ConnectorOutput(finished=["c"]), ConnectorOutput(finished=["c"])], [])
    assert out.finished == ["c"] and out.failed == {}
