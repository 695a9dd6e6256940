"""benchmarks.step_phases: nested timers count each phase's own time, per step kind."""

from __future__ import annotations

import pytest

from benchmarks import step_phases


def test_nested_phases_keep_their_own_time(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([0.0, 1.0, 3.0, 4.0, 4.5, 10.0, 20.0, 21.0, 22.0, 26.0])
    monkeypatch.setattr(step_phases.time, "perf_counter", lambda: next(clock))
    t = step_phases.PhaseTimer()
    t.kind = "prefill"
    t.push("step")          # 0
    t.push("linears")       # 1
    t.pop()                 # 3: linears 2
    t.push("GDN")           # 4
    t.pop()                 # 4.5: GDN 0.5
    t.pop()                 # 10: step's own 10 - 2.5
    t.end_step()
    t.kind = "decode"
    t.push("step")          # 20
    t.push("linears")       # 21
    t.pop()                 # 22
    t.pop()                 # 26
    t.end_step()
    assert dict(t.totals["prefill"]) == {"linears": 2.0, "GDN": 0.5, "rest of step": 7.5}
    assert dict(t.totals["decode"]) == {"linears": 1.0, "rest of step": 5.0}
    assert t.steps == {"prefill": 1, "decode": 1}
    table = t.table()
    assert "prefill steps: 1, 10.00 s" in table and "75.0%" in table
