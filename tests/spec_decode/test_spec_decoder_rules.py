"""``SpecDecoder``'s rules on a stand-in scheduler (no model, no cache): which requests get
drafts on a step, the room left by ``max_model_len`` and ``max_tokens``, the batch-size cut,
the hybrid rule, exclusions, the back-off, adaptive k, the counters and their log line. Each
expected figure is worked out by hand from ``spec_decode/engine.py``'s docstrings (written
for mutmut's survivors)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from pagefold.core.sched_output import VerifiedTokens
from pagefold.spec_decode import engine as engine_mod
from pagefold.spec_decode.config import SpeculativeConfig
from pagefold.spec_decode.engine import SpecDecoder, SpecMetrics


def _req(rid: str, num_tokens: int = 10, computed: int | None = None, outputs: int = 2,
         max_tokens: int | None = None, paused: bool = False, structured=None,
         tokens: list[int] | None = None) -> SimpleNamespace:
    """A decoding request: one token not yet computed (``computed = num_tokens - 1``)."""
    return SimpleNamespace(
        request_id=rid, paused=paused, num_tokens=num_tokens,
        num_computed_tokens=num_tokens - 1 if computed is None else computed,
        output_token_ids=[5] * outputs, num_output_tokens=outputs,
        all_token_ids=tokens if tokens is not None else list(range(num_tokens)),
        sampling_params=SimpleNamespace(structured_outputs=structured, max_tokens=max_tokens))


def _sched(*reqs, waiting: int = 0, extra: tuple[str, ...] = ()) -> SimpleNamespace:
    requests = {r.request_id: r for r in reqs} | {x: None for x in extra}
    return SimpleNamespace(requests=requests, running=list(reqs), num_waiting=waiting,
                           spec_token_ids={"stale": [1]})


def _decoder(k: int = 3, max_model_len: int = 100, has_state: bool = False, **extra):
    cfg = SpeculativeConfig.from_user({"method": "mtp", "num_speculative_tokens": k} | extra)
    dec = SpecDecoder(cfg, max_model_len, has_state=has_state)
    calls: list[tuple[str, int]] = []

    def propose(r, kk):
        calls.append((r.request_id, kk))
        return [] if r.request_id.startswith("empty") else [7] * kk

    dec.propose_fn = propose
    return dec, calls


def test_metrics_by_hand(caplog) -> None:
    m = SpecMetrics()
    assert (m.acceptance_rate, m.mean_accepted_length) == (0.0, 0.0)
    assert m.summary() == ("spec decode: 0 rounds, 0 drafted, 0 accepted (0.0%), "
                           "mean accepted length 0.00")
    m.observe(3, 2)
    m.observe(2, 0)
    m.observe(4, 4)
    # Positions: round 1 accepts 0,1; round 2 none; round 3 accepts 0..3.
    assert (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens) == (3, 9, 6)
    assert m.accepted_per_pos == [2, 2, 1, 1]
    assert m.acceptance_rate == 6 / 9
    assert m.mean_accepted_length == 3.0
    assert m.summary() == ("spec decode: 3 rounds, 9 drafted, 6 accepted (66.7%), "
                           "mean accepted length 3.00")


def test_which_requests_draft_and_how_many() -> None:
    dec, calls = _decoder(k=3, max_model_len=20)
    reqs = [
        _req("ok"),
        _req("paused", paused=True),
        _req("grammar", structured=object()),
        _req("excluded"),
        _req("prefill", num_tokens=10, computed=8),       # two tokens to compute
        _req("nothing_new", num_tokens=10, computed=10),
        _req("no_output", outputs=0),
        _req("room2", num_tokens=17),                     # 20 - 17 - 1 = 2
        _req("room1", num_tokens=18),
        _req("room0", num_tokens=19),
        _req("mt1", max_tokens=10, outputs=8),            # 10 - 8 - 1 = 1
        _req("mt0", max_tokens=10, outputs=9),
        _req("mt_big", max_tokens=100, outputs=1),
        _req("empty"),                                    # the proposer finds nothing
    ]
    dec.exclude("excluded")
    dec.forget("never-excluded")  # forgetting an unknown id is a no-op
    dec.disable_by_batch_size = 100
    s = _sched(*reqs)
    dec.propose(s)
    assert calls == [("ok", 3), ("room2", 2), ("room1", 1), ("mt1", 1), ("mt_big", 3),
                     ("empty", 3)]
    assert s.spec_token_ids == {"ok": [7] * 3, "room2": [7] * 2, "room1": [7], "mt1": [7],
                                "mt_big": [7] * 3}
    dec.forget("excluded")
    calls.clear()
    dec.propose(_sched(_req("excluded")))
    assert calls == [("excluded", 3)]


def test_batch_size_cut() -> None:
    # No explicit disable_by_batch_size: speculation stops at 8 running requests.
    dec, calls = _decoder()
    assert dec.disable_by_batch_size == 8
    s = _sched(*[_req(f"r{i}") for i in range(7)])
    dec.propose(s)
    assert len(s.spec_token_ids) == 7
    s = _sched(*[_req(f"r{i}") for i in range(8)])
    dec.propose(s)
    assert s.spec_token_ids == {}
    dec, calls = _decoder(disable_by_batch_size=2)
    assert dec.disable_by_batch_size == 2
    s = _sched(_req("a"))
    dec.propose(s)
    assert list(s.spec_token_ids) == ["a"]
    s = _sched(_req("a"), _req("b"))
    dec.propose(s)
    assert s.spec_token_ids == {}
    s = _sched()
    dec.propose(s)
    assert s.spec_token_ids == {}  # the previous step's drafts never linger


def test_hybrids_draft_only_on_steps_without_prefill() -> None:
    # prefill: tokens left to compute of another running request (0: none running).
    for has_state, waiting, prefill, drafts in [
        (True, 0, 0, True), (True, 1, 0, False), (True, 0, 2, False), (True, 0, 5, False),
        (False, 1, 5, True),
    ]:
        dec, _ = _decoder(has_state=has_state)
        extra = [_req("p", computed=10 - prefill)] if prefill else []
        s = _sched(_req("a"), *extra, waiting=waiting)
        dec.propose(s)
        assert ("a" in s.spec_token_ids) is drafts, (has_state, waiting, prefill)
    # has_state defaults to False: a plain model drafts beside prefill work.
    dec = SpecDecoder(SpeculativeConfig.from_user({"method": "mtp"}), 100)
    s = _sched(_req("a"), _req("p", computed=5), waiting=1)
    dec.propose(s)
    assert s.spec_token_ids == {"a": [-1]}


def _verify(dec, s, sampled) -> None:
    dec.observe(SimpleNamespace(spec_token_ids=dict(s.spec_token_ids)), sampled)


def test_backoff_and_counters() -> None:
    dec, calls = _decoder(k=2)
    s = _sched(_req("b"), _req("a"))  # a backed-off request skips only itself
    dec.propose(s)                                        # step 1: both draft 2
    _verify(dec, s, {"a": VerifiedTokens([1, 2, 3], 2), "b": VerifiedTokens([9], 0)})
    assert (dec.metrics.num_drafts, dec.metrics.num_draft_tokens,
            dec.metrics.num_accepted_tokens) == (2, 4, 2)
    # b failed once: no drafts before step 1 + 2 = 3.
    seen = []
    for _ in range(2):
        dec.propose(s)
        seen.append(sorted(s.spec_token_ids))
    assert seen == [["a"], ["a", "b"]]                    # steps 2 and 3
    _verify(dec, s, {"a": [4], "b": VerifiedTokens([9], 0)})  # a: not a verify result
    assert dec.metrics.num_drafts == 3                    # only b's round counted
    # b failed twice: no drafts before step 3 + 4 = 7.
    seen = []
    for _ in range(4):
        dec.propose(s)
        seen.append("b" in s.spec_token_ids)
    assert seen == [False, False, False, True]            # steps 4..7
    _verify(dec, s, {"b": VerifiedTokens([1, 2, 3], 2)})  # an acceptance resets it
    dec.propose(s)                                        # step 8
    assert "b" in s.spec_token_ids
    _verify(dec, s, {"b": VerifiedTokens([9], 0)})        # a first failure again: wait 2
    seen = []
    for _ in range(2):
        dec.propose(s)
        seen.append("b" in s.spec_token_ids)
    assert seen == [False, True]                          # steps 9 and 10


def test_backoff_caps_at_16_steps() -> None:
    dec, _ = _decoder(k=2)
    s = _sched(_req("b"))
    steps = []
    for step in range(1, 81):
        dec.propose(s)
        if s.spec_token_ids:
            steps.append(step)
            _verify(dec, s, {"b": VerifiedTokens([9], 0)})
    # Waits after each failed round: 2, 4, 8, 16, then 16 (capped) each time.
    assert steps == [1, 3, 7, 15, 31, 47, 63, 79]


@pytest.mark.parametrize("adaptive, ks", [(True, [4, 4, 3, 2, 1]), (False, [4, 4, 4, 4, 4])])
def test_adaptive_k_follows_acceptance(adaptive, ks) -> None:
    dec, calls = _decoder(k=4, adaptive_k=adaptive)
    s = _sched(_req("a"))
    # next_k: 4 of 4 -> min(4, 4 + 1) = 4; 2 of 4 -> 3; 1 of 3 -> 2; 0 of 2 -> 1, and the
    # round accepting nothing backs off 2 steps (step 5 has no drafts, step 6 has).
    for accepted in (4, 2, 1, 0):
        dec.propose(s)
        _verify(dec, s, {"a": VerifiedTokens([1] * (accepted + 1), accepted)})
    dec.propose(s)
    assert s.spec_token_ids == {}
    dec.propose(s)
    assert calls == [("a", k) for k in ks]


def test_pruning_keeps_live_requests() -> None:
    dec, calls = _decoder(k=4, adaptive_k=True)
    live, dud = _req("live"), _req("dud")
    s = _sched(live, dud, extra=("live-excluded",))
    dec.propose(s)                                           # step 1
    _verify(dec, s, {"live": VerifiedTokens([1, 2], 1),      # adaptive: k -> 2
                     "dud": VerifiedTokens([9], 0)})         # back-off until step 3
    dec.exclude("live-excluded")
    for i in range(74):
        dec.exclude(f"gone{i}")
    # 75 excluded + 1 backed off = 76 <= 4 * 3 + 64 = 76: nothing pruned.
    dec.propose(s)                                           # step 2
    assert len(dec.excluded) == 75 and sorted(s.spec_token_ids) == ["live"]
    dec.exclude("gone74")
    # 77 > 76: pruned to the live requests, their back-off and k kept.
    dec.propose(s)                                           # step 3
    assert dec.excluded == {"live-excluded"}
    assert calls[-2:] == [("live", 2), ("dud", 1)]  # 0 of 4 accepted: k 1
    _verify(dec, s, {"dud": VerifiedTokens([9], 0)})        # second failure: wait 4
    seen = []
    for _ in range(4):                                       # steps 4..7
        dec.propose(s)
        seen.append("dud" in s.spec_token_ids)
    assert seen == [False, False, False, True]


def test_ngram_and_placeholders() -> None:
    cfg = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 3,
                                       "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    dec = SpecDecoder(cfg, 100)
    s = _sched(_req("a", num_tokens=8, tokens=[1, 2, 3, 4, 9, 1, 2, 3]))
    dec.propose(s)
    # The suffix [1, 2, 3] matched at 0: the next three tokens 4, 9, 1.
    assert s.spec_token_ids == {"a": [4, 9, 1]}
    for method, extra in [("mtp", {}), ("eagle", {"model": "/e"})]:
        cfg = SpeculativeConfig.from_user({"method": method, "num_speculative_tokens": 2}
                                          | extra)
        dec = SpecDecoder(cfg, 100)
        s = _sched(_req("a"))
        dec.propose(s)
        assert s.spec_token_ids == {"a": [-1, -1]}  # the runner fills the placeholders


def test_log_line_every_10_seconds(monkeypatch, caplog) -> None:
    now = [100.0]
    monkeypatch.setattr(engine_mod.time, "monotonic", lambda: now[0])
    dec, _ = _decoder()
    out = SimpleNamespace(spec_token_ids={})
    logs = []
    with caplog.at_level(logging.INFO, logger="pagefold"):
        for t in (109.9, 110.0, 119.9, 120.0):
            now[0] = t
            caplog.clear()
            dec.observe(out, {})
            logs.append([r.getMessage() for r in caplog.records])
    line = "spec decode: 0 rounds, 0 drafted, 0 accepted (0.0%), mean accepted length 0.00"
    assert logs == [[], [line], [], [line]]
