"""The data-parallel router against a reference choice written here, driven by ``hypothesis``.

The documented rule (``pagefold/engine/dp_client.py``): a replica's load is its in-flight
requests plus its waiting queue, ties broken by KV-cache usage, then by index. A prompt whose
longest remembered prefix (its first 1, 2, 4, ... full blocks, with at least one token after
them) was last sent to replica ``o`` goes to ``o`` unless ``o``'s load exceeds the least
loaded replica's by more than ``prefix_slack``; every prefix of the prompt then belongs to the
replica chosen. Sequences of picks over every load signal, inside and outside the slack,
with recurring prefixes, must agree pick for pick.
"""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pagefold.engine.dp_client import LoadBalancer, ReplicaLoad  # noqa: E402


class Reference:
    """The rule, written plainly: prefixes are kept as token tuples, not hashes."""

    def __init__(self, n: int, block_size: int, slack: int) -> None:
        self.n, self.bs, self.slack = n, block_size, slack
        self.owner: dict[tuple[int, ...], int] = {}

    def pick(self, prompt: list[int], loads: list[tuple[int, int, float]]) -> int:
        load = [f + w for f, w, _ in loads]
        least = min(range(self.n), key=lambda i: (load[i], loads[i][2], i))
        prefixes = []
        k = 1
        while k * self.bs < len(prompt):
            prefixes.append(tuple(prompt[: k * self.bs]))
            k *= 2
        choice = least
        known = [p for p in prefixes if p in self.owner]
        if known:
            o = self.owner[max(known, key=len)]
            if load[o] - load[least] <= self.slack:
                choice = o
        for p in prefixes:
            self.owner[p] = choice
        return choice


_PI = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
# Prompts share 2, 4, 8 or 16 leading tokens with the first, so prefixes of several lengths
# are known at once, owned by different replicas.
BASES = [_PI, [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5, 2, 3, 5, 3]]
BASES += [_PI[:k] + [0] * (20 - k) for k in (2, 4, 8, 16)]


@st.composite
def scenarios(draw):
    n = draw(st.integers(2, 4))
    bs = draw(st.integers(1, 4))
    slack = draw(st.integers(0, 3))
    usage = st.sampled_from([0.0, 0.1, 0.5, 0.5, 0.9])  # repeated values make ties
    steps = []
    for _ in range(draw(st.integers(1, 12))):
        base = draw(st.sampled_from(BASES))
        cut = draw(st.integers(0, len(base)))
        tail = draw(st.lists(st.integers(10, 12), max_size=3))
        prompt = base[:cut] + tail or [11]
        loads = [(draw(st.integers(0, 6)), draw(st.integers(0, 6)), draw(usage))
                 for _ in range(n)]
        steps.append((prompt, loads))
    return n, bs, slack, steps


@settings(max_examples=200, deadline=None, derandomize=True)
@given(scenarios())
def test_router_equals_the_reference(case):
    n, bs, slack, steps = case
    lb = LoadBalancer(n, block_size=bs, prefix_slack=slack)
    ref = Reference(n, bs, slack)
    for prompt, loads in steps:
        got = lb.pick(list(prompt), [ReplicaLoad(f, w, u) for f, w, u in loads])
        assert got == ref.pick(prompt, loads), (prompt, loads)


# Hand-picked sequences the random search may miss: (prompt, loads) per pick, at bs 2, slack 0.
SEQUENCES = {
    # The longest known prefix decides: _PI[:4]'s owner moved to 1, _PI[:2]'s stayed on 0.
    "longest_prefix_wins": [(_PI[:5], [(0, 0, 0.0)] * 2),
                            (_PI[:2] + [10], [(5, 0, 0.0), (0, 0, 0.0)]),
                            (_PI[:4] + [11], [(0, 0, 0.0), (0, 0, 0.5)])],
    # A prompt is never its own prefix: _PI[:8] alone must not record the 8-token key, else
    # a later _PI[:8] + [10] follows it there instead of its 4-token prefix's new owner.
    "no_whole_prompt_key": [(_PI[:8], [(0, 0, 0.0)] * 2),
                            (_PI[:4] + [10, 11, 12], [(5, 0, 0.0), (0, 0, 0.0)]),
                            (_PI[:8] + [10], [(0, 0, 0.0)] * 2)],
}


@pytest.mark.parametrize("name", sorted(SEQUENCES))
def test_router_equals_the_reference_on_chosen_sequences(name):
    lb, ref = LoadBalancer(2, block_size=2, prefix_slack=0), Reference(2, 2, 0)
    picks = [(lb.pick(list(p), [ReplicaLoad(*x) for x in loads]), ref.pick(p, loads))
             for p, loads in SEQUENCES[name]]
    assert [a for a, _ in picks] == [b for _, b in picks]
    assert len({b for _, b in picks}) == 2  # the sequence does move between replicas


@pytest.mark.parametrize("busy,slack,expect", [
    ((3, 0), 3, 0),  # exactly at the slack: the prefix's replica
    ((4, 0), 3, 1),  # one past it: load wins
    ((0, 0), 0, 0),  # even at slack 0, a tie keeps the prefix
])
def test_slack_edge_counts_waiting_requests(busy, slack, expect):
    """The owner's load at the slack's edge, made of waiting requests only (the router must
    count them exactly as in-flight ones)."""
    lb = LoadBalancer(2, block_size=2, prefix_slack=slack)
    prompt = [5, 6, 7, 8, 9]
    assert lb.pick(prompt, [ReplicaLoad(0, 0, 0.0), ReplicaLoad(0, 0, 0.5)]) == 0
    loads = [ReplicaLoad(0, busy[0], 0.0), ReplicaLoad(0, busy[1], 0.0)]
    assert lb.pick(prompt, loads) == expect
