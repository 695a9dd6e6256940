"""benchmarks.compare --sweep: workload generation and the driver's submission modes, with a
fake engine (no model, no subprocess)."""

from __future__ import annotations

from benchmarks.compare import _drive
from benchmarks.sweep import CONV_TURNS, QUICK, SHAPES, SYSTEM_PROMPT, _gmean, make_sweep_work


class FakeEngine:
    """Answers every request with ``out`` copies of its prompt length (mod 100) in one step;
    records what was submitted together."""

    def __init__(self) -> None:
        self.pending: dict[str, dict] = {}
        self.batches: list[list[str]] = []
        self.prompts: dict[str, list[int]] = {}

    def add(self, rid: str, w: dict) -> None:
        if not self.pending:
            self.batches.append([])
        self.batches[-1].append(rid)
        self.pending[rid] = w
        self.prompts[rid] = w["ids"]

    def step(self):
        out = [(rid, w["out"], True, [len(w["ids"]) % 100] * w["out"])
               for rid, w in self.pending.items()]
        self.pending = {}
        return out


def test_sweep_work_shapes_and_prefixes():
    work = make_sweep_work(vocab=500, seed=0, quick=False, big=False)
    assert set(work) == {"tput", "b1", "long", "sys", "conv"}
    sys_work, mode = work["sys"]
    assert mode == "lead" and len(sys_work) == 16
    prefix = sys_work[0]["ids"][:SYSTEM_PROMPT]
    assert all(w["ids"][:SYSTEM_PROMPT] == prefix for w in sys_work)
    assert all(len(w["ids"]) >= 3000 for w in work["long"][0])
    conv, mode = work["conv"]
    assert mode == "conv" and len(conv["msgs"]) == CONV_TURNS - 1
    quick = make_sweep_work(vocab=500, seed=0, quick=True, big=True)
    assert len(quick["tput"][0]) == 8 and len(quick["b1"][0]) == 2  # b1 never shrinks
    assert set(QUICK) <= {s.name for s in SHAPES}
    assert {s.arch for s in SHAPES} == {"qwen3", "qwen3_5", "nemotron_h", "qwen3_next"}


def test_drive_lead_and_conversation_modes():
    eng = FakeEngine()
    work = [{"ids": [1] * n, "out": 3} for n in (5, 6, 7)]
    res = _drive(eng.add, eng.step, work, "lead")
    assert eng.batches == [["0"], ["1", "2"]] and res["n_out"] == 9
    eng = FakeEngine()
    conv = {"first": [[1] * 10, [2] * 20], "msgs": [[[3], [4, 4]], [[5], [6]]], "out": 2}
    res = _drive(eng.add, eng.step, conv, "conv")
    assert eng.batches == [["0-0", "0-1"], ["1-0", "1-1"], ["2-0", "2-1"]]
    # Turn 2 = turn 1 prompt + the engine's own answer + the next message.
    assert eng.prompts["1-0"] == [1] * 10 + [10, 10] + [3]
    assert eng.prompts["2-1"] == [2] * 20 + [20, 20] + [4, 4] + [24, 24] + [6]
    assert res["n_out"] == 12


def test_gmean_skips_missing_cells():
    assert abs(_gmean([2.0, 0.5, None]) - 1.0) < 1e-12
    assert _gmean([None]) is None


def test_run_sweep_row_workloads_and_best_vllm_row(monkeypatch, qwen3_dir, tmp_path, capsys):
    """``--row-workloads vllm=b1`` hands that row only batch-1 work; each cell's reference is
    the faster vLLM row that ran it (here: the one-thread row on b1, vllm-r0 elsewhere)."""
    import json
    from types import SimpleNamespace

    import benchmarks.compare as compare
    from benchmarks.sweep import run_sweep

    monkeypatch.setattr(compare, "measure_bandwidth",
                        lambda r: r.update(copy_gbps=10.0, read_gbps=20.0))
    seen: dict[str, set[str]] = {}
    # seconds / TPOT per (system, workload): pagefold twice as fast as vllm-r0 everywhere;
    # the one-thread row is faster than vllm-r0 on b1 (and would be on tput, had it run).
    speed = {"pagefold": 1.0, "vllm": 1.5, "vllm-r0": 2.0, "transformers": 8.0}

    def run_one(system: str, spec: dict) -> dict:
        seen[system] = set(spec["work"])
        return {"threads": 2, "results": {
            w: {"seconds": speed[system], "n_out": 1, "ttft": 0.1,
                "tpot": speed[system] / 100} for w in spec["work"]}}

    args = SimpleNamespace(quick=True, shapes=["none"], real_model=str(qwen3_dir), seed=0,
                           sweep_workloads=None, repeat=1, row_workloads=["vllm=b1"],
                           json=str(tmp_path / "sweep.json"))
    run_sweep(args, ["pagefold", "transformers", "vllm", "vllm-r0"], run_one, tmp_path)
    assert seen["vllm"] == {"b1"}
    assert seen["vllm-r0"] == seen["pagefold"] == {"tput", "b1", "long", "sys", "conv"}
    saved = json.loads((tmp_path / "sweep.json").read_text())
    row = saved["sweep"][0]
    assert abs(row["b1 /vLLM"] - 1.5) < 1e-9  # the one-thread row's TPOT
    # The seconds behind the ratios: one record per (system, workload) that ran.
    raw = {(r["system"], r["workload"]): r for r in saved["raw"]}
    assert len(raw) == 5 * 3 + 1 and raw[("vllm", "b1")]["seconds"] == 1.5
    assert raw[("vllm-r0", "long")]["tpot"] == 0.02 and ("vllm", "tput") not in raw
    assert abs(row["tput /vLLM"] - 2.0) < 1e-9 and abs(row["conv /vLLM"] - 2.0) < 1e-9
    assert abs(row["tput /HF"] - 8.0) < 1e-9
    assert "geometric mean" in capsys.readouterr().out
