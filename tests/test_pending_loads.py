"""The worker side's bookkeeping of asynchronous loads (offload disk reads, P/D pulls): each
request reported once, when its last load lands, with its failed keys; a cancelled one never."""

from pagefold.core.kv_connector import ConnectorOutput, PendingLoads


def test_a_request_is_reported_once_when_its_last_load_lands_with_its_failed_keys():
    p, out = PendingLoads(), ConnectorOutput()
    p.start("a")
    p.start("a")
    p.start("b")
    assert p and "a" in p and "c" not in p
    p.fail("a", "k1")
    p.landed("a", out)
    assert out.finished == [] and "a" in p  # one of a's two loads is still in flight
    p.landed("a", out)
    assert out.finished == ["a"] and out.failed == {"a": ["k1"]} and "a" not in p
    p.landed("b", out)
    assert out.finished == ["a", "b"] and "b" not in out.failed and not p


def test_a_cancelled_request_writes_nothing_and_is_never_reported():
    p, out = PendingLoads(), ConnectorOutput()
    p.start("a")
    p.fail("a", "k0")
    p.cancel("a")
    assert not p.wanted("a")
    p.landed("a", out)
    assert out.finished == [] and out.failed == {} and not p
    p.start("a")  # the same id loading again later is wanted again
    assert p.wanted("a")
    p.landed("a", out)
    assert out.finished == ["a"] and out.failed == {}


def test_cancelling_a_request_with_nothing_in_flight_leaves_it_wanted():
    p, out = PendingLoads(), ConnectorOutput()
    p.cancel("x")
    assert p.wanted("x") and not p
    p.report("x", out)  # host-only loads finish at once
    assert out.finished == ["x"]
