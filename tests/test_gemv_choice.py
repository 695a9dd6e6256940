"""The GEMV chooser (``csrc/gemv_choice.py``): decisions from fake timing tables, the cache
file (round trip; corrupt, truncated and foreign files ignored and rewritten), the overrides,
and every registered kernel against a float64 reference on awkward shapes. No test depends on
real timings."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
import torch.nn.functional as F

from pagefold.csrc import cpu_ops, gemv_choice, gemv_registry
from pagefold.csrc.gemv_choice import ROWS

INF = math.inf


@pytest.fixture
def lib():
    got = cpu_ops.kernels()
    if got is None:
        pytest.skip("no compiled CPU kernels")
    return got


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    """A cache directory of the test's own, no override, and nothing memoised."""
    monkeypatch.setenv("PAGEFOLD_CACHE", str(tmp_path))
    monkeypatch.delenv("PAGEFOLD_GEMV", raising=False)
    monkeypatch.setattr(gemv_choice, "_forced", [None])
    monkeypatch.setattr(gemv_choice, "_memo", {})


def _flat(us: float) -> dict[int, float]:
    return dict.fromkeys(ROWS, us)


def test_decide_picks_the_fastest_kernel_and_its_row_limit():
    table = {"a": {1: 10, 2: 11, 4: 12, 8: 14, 16: 30, 32: 60},
             "b": {1: 20, 2: 21, 4: 22, 8: 24, 16: 28, 32: 40}}
    gemm = {1: 50, 2: 50, 4: 50, 8: 50, 16: 25, 32: 30}
    # a wins at 1-8 rows; past 8 the GEMM is faster than a: a for 1-8, the GEMM above
    assert gemv_choice.decide(table, gemm, None) == ("a", 8)
    # the incumbent (b for 1-32) costs more than 1 / KEEP times the best: replaced by a, and
    # for 16 rows: 16 rows on the GEMM path would leave the native decode driver (DRIVER_COST)
    assert gemv_choice.decide(table, gemm, ("b", 32)) == ("a", 16)
    assert gemv_choice.decide(table, gemm, ("b", 4)) == ("a", 8)


def test_decide_counts_the_native_driver_under_the_flags_rows():
    """A kernel 20% faster at 1-2 rows and far slower above, the GEMM path close to the
    incumbent at 4-32 rows: per shape (a, 2) costs least, but rows the incumbent keeps on its
    GEMV and the pick would not leave the native decode driver (DRIVER_COST), so the
    incumbent stays; with a lower incumbent limit, or none, the narrow pick is taken."""
    table = {"a": {1: 8, 2: 8, 4: 40, 8: 80, 16: INF, 32: INF},
             "b": {1: 10, 2: 10, 4: 10, 8: 11, 16: 12, 32: 13}}
    gemm = {1: 14, 2: 14, 4: 11, 8: 11.5, 16: 12, 32: 13}
    assert gemv_choice.decide(table, gemm, None) == ("a", 2)
    assert gemv_choice.decide(table, gemm, ("b", 32)) == ("b", 32)
    assert gemv_choice.decide(table, gemm, ("b", 2)) == ("a", 2)
    # every kernel pruned before the incumbent's rows: the cheapest narrow pick
    table["b"] = {1: 10, 2: 10, 4: INF, 8: INF, 16: INF, 32: INF}
    assert gemv_choice.decide(table, gemm, ("c", 32)) == ("a", 2)


def test_decide_keeps_the_incumbent_within_the_margin():
    table = {"a": _flat(10.0), "b": _flat(10.5)}
    gemm = _flat(100.0)
    assert gemv_choice.decide(table, gemm, ("b", 32)) == ("b", 32)
    assert gemv_choice.decide(table, gemm, None) == ("a", 32)
    table["b"] = _flat(12.0)  # past the margin
    assert gemv_choice.decide(table, gemm, ("b", 32)) == ("a", 32)


def test_decide_reads_a_slow_reading_at_fewer_rows_as_noise():
    """The incumbent's 1-row call was preempted (100 against 10 at every other count): more
    rows bound fewer rows' time from above, so it stays."""
    table = {"a": {1: 100, 2: 10, 4: 10, 8: 11, 16: 12, 32: 13}, "b": _flat(10.5)}
    assert gemv_choice.decide(table, _flat(100.0), ("a", 32)) == ("a", 32)
    table["a"] = {1: 10, 2: 100, 4: 100, 8: 100, 16: 100, 32: 100}  # really slow: b
    assert gemv_choice.decide(table, _flat(100.0), ("a", 32)) == ("b", 32)


def test_decide_skips_pruned_rows_and_takes_at_least_one_row():
    table = {"a": {1: 5, 2: 6, 4: INF, 8: INF, 16: INF, 32: INF}}
    gemm = {1: 1, 2: 1, 4: 1, 8: 1, 16: 1, 32: 1}  # the GEMM faster everywhere
    assert gemv_choice.decide(table, gemm, None) == ("a", 1)
    assert gemv_choice.decide({}, gemm, None) == ("torch", 0)


def _fake_timer(fastest: str, calls: list):
    def timer(shape, kernels, keep):
        calls.append((shape, sorted(kernels)))
        table = {name: _flat(10.0 if name == fastest else 40.0) for name in kernels}
        return table, _flat(100.0)
    return timer


def test_choose_takes_the_fastest_runnable_kernel(lib):
    names = [c.name for c in gemv_choice.available(lib)]
    if len(names) < 2:
        pytest.skip("one GEMV kernel on this CPU: nothing to choose")
    # the one the flags would not pick, made fastest by the fake table
    other = next(n for n in names if n != gemv_registry.flag_default(names))
    calls: list = []
    got = gemv_choice.choose(lib, [(1024, 512), (1024, 512), (64, 64), (1023, 512)],
                             timer=_fake_timer(other, calls))
    assert got[(1024, 512)].name == other and got[(1024, 512)].max_rows == 32
    assert got[(1024, 512)].fn is getattr(lib, gemv_registry.by_name(other).symbol)
    # bf16 weights under 1 MiB (the call, not the kernel, would be timed) take the flags'
    # choice, untimed; a change is timed twice
    assert got[(64, 64)].name == gemv_registry.flag_default(names)
    assert got[(1023, 512)].name == gemv_registry.flag_default(names)
    assert calls == [((1024, 512), sorted(names))] * 2


def test_a_change_two_measurements_disagree_on_keeps_the_flags_choice(lib):
    names = [c.name for c in gemv_choice.available(lib)]
    if len(names) < 2:
        pytest.skip("one GEMV kernel on this CPU: nothing to choose")
    flags = gemv_registry.flag_default(names)
    other = next(n for n in names if n != flags)
    answers = [_fake_timer(other, []), _fake_timer(flags, [])]  # noise: then the flags' one

    def timer(shape, kernels, keep):
        return answers.pop(0)(shape, kernels, keep)

    got = gemv_choice.choose(lib, [(1024, 512)], timer=timer)
    assert got[(1024, 512)].name == flags and not answers


def test_choose_skips_a_kernel_that_fails_its_self_check(lib):
    names = [c.name for c in gemv_choice.available(lib)]
    bad = names[0]
    calls: list = []
    got = gemv_choice.choose(lib, [(2048, 256)], timer=_fake_timer(bad, calls),
                             check=lambda c, _lib: c.name != bad)
    assert all(bad not in ks for _, ks in calls)
    assert got[(2048, 256)].name != bad


def test_choose_falls_back_to_torch_when_nothing_runs(lib):
    got = gemv_choice.choose(lib, [(2048, 256)], timer=_fake_timer("fma", []),
                             check=lambda c, _lib: False)
    assert got[(2048, 256)] == gemv_choice.NO_GEMV
    assert gemv_choice.choose(None, [(8, 8)])[(8, 8)] == gemv_choice.NO_GEMV


def test_self_check_rejects_a_wrong_kernel(lib):
    c = gemv_choice.available(lib)[0]
    fn = getattr(lib, c.symbol)
    assert gemv_registry.self_check(fn)

    def off_by_one_row(x, xs, w, b, y, ys, m, n, k, nt):  # drops the last output row
        return fn(x, xs, w, b, y, ys, m, n - 1, k, nt)

    assert not gemv_registry.self_check(off_by_one_row)


def test_cache_round_trip_then_corrupt_and_foreign_files_are_rewritten(lib, caplog):
    calls: list = []
    shapes = [(1024, 512), (512, 1536)]
    flags = gemv_registry.flag_default([c.name for c in gemv_choice.available(lib)])
    first = gemv_choice.choose(lib, shapes, timer=_fake_timer(flags, calls))
    key = gemv_choice.cache_key(lib, [c.name for c in gemv_choice.available(lib)])
    path = gemv_choice.cache_path(key)
    data = json.loads(path.read_text())
    assert data["key"] == key and set(data["shapes"]) == {"1024x512", "512x1536"}
    assert len(calls) == 2

    gemv_choice._memo.clear()  # a later process: read, no timing
    again = gemv_choice.choose(lib, shapes, timer=_fake_timer(flags, calls))
    assert len(calls) == 2 and again == first

    text = path.read_text()
    foreign = json.loads(text)
    foreign["key"]["cpu"] = "another CPU"
    for bad in (text[: len(text) // 2], "{not json", json.dumps(foreign),
                text.replace(f'"kernel": "{first[(1024, 512)].name}"', '"kernel": "quantum"')):
        path.write_text(bad)
        gemv_choice._memo.clear()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pagefold"):
            got = gemv_choice.choose(lib, shapes, timer=_fake_timer(flags, calls))
        assert "ignoring the choice cache" in caplog.text
        assert got == first  # timed again (the fake table decides as before)
        assert json.loads(path.read_text())["key"] == key  # rewritten, valid


def test_env_and_option_force_one_kernel(lib, monkeypatch):
    names = [c.name for c in gemv_choice.available(lib)]
    forced = names[-1]
    monkeypatch.setenv("PAGEFOLD_GEMV", forced)
    got = gemv_choice.choose(lib, [(1024, 512)], timer=_fake_timer(names[0], []))
    c = gemv_registry.by_name(forced)
    assert got[(1024, 512)].name == forced and got[(1024, 512)].max_rows == c.default_rows
    assert cpu_ops.default_choice().name == forced
    gemv_choice.set_forced("torch")  # the option wins over the environment
    assert gemv_choice.choose(lib, [(1024, 512)])[(1024, 512)] == gemv_choice.NO_GEMV
    gemv_choice.set_forced("flags")
    flags = gemv_registry.flag_default(names)
    assert gemv_choice.choose(lib, [(1024, 512)])[(1024, 512)].name == flags
    with pytest.raises(ValueError, match="cpu_gemv_kernel must be one of"):
        gemv_choice.set_forced("fastest")
    missing = [n for n in gemv_registry.NAMES if n not in names]
    if missing:  # a known kernel this machine cannot run: the error lists the ones it can
        gemv_choice.set_forced(missing[0])
        with pytest.raises(ValueError, match=", ".join(names)):
            gemv_choice.choose(lib, [(1024, 512)])


def test_engine_option_is_checked():
    from pagefold.config import EngineConfig

    assert EngineConfig("m", cpu_gemv_kernel="FMA").cpu_gemv_kernel == "fma"
    with pytest.raises(ValueError, match="cpu_gemv_kernel"):
        EngineConfig("m", cpu_gemv_kernel="gpu")


def test_forcing_the_gemv_keeps_onednn_for_larger_products(lib, monkeypatch):
    """The override is about the GEMV only: above its rows a routed linear still takes the
    pre-reordered oneDNN weight (unlike PAGEFOLD_NATIVE_BF16=0, which changes both)."""
    monkeypatch.setenv("PAGEFOLD_GEMV", gemv_choice.available(lib)[-1].name)
    lin = torch.nn.Linear(64, 96, dtype=torch.bfloat16)
    cpu_ops.use_fast_linears(lin)
    assert lin.pf_gemv is not None
    if not cpu_ops.gemm.upcast_enabled():
        assert lin.pf_packed_weight is not None
        x = torch.randn(40, 64).bfloat16()
        with torch.no_grad():
            assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    ia = a.view(torch.int16).to(torch.int32)
    ib = b.view(torch.int16).to(torch.int32)
    # bf16 bit patterns are ordered like the values within a sign
    return torch.where((ia < 0) == (ib < 0), (ia - ib).abs(), torch.full_like(ia, 1 << 16))


@pytest.mark.parametrize("n,k,bias", [(77, 100, True), (130, 579, False), (3, 7, True),
                                      (33, 96, False)],
                         ids=["k-tail-bias", "k-tail-wide", "k-under-8", "k32x"])
def test_every_candidate_matches_the_float_product(lib, n, k, bias):
    """Rows 1..33 (33: past every kernel's tiles), K not a multiple of any vector width or
    of the AMX tile's 32: each kernel's output is the exact product rounded once to bf16, up
    to a last-bit difference of the summation order on at most 3% of the outputs; and a
    row's bits do not depend on how many rows share the call."""
    g = torch.Generator().manual_seed(n * 31 + k)
    x_all = torch.randn(33, 2 * k, generator=g).bfloat16()[:, :k]  # strided rows
    w = (torch.randn(n, k, generator=g) * k**-0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    for c in gemv_choice.available(lib):
        fn = getattr(lib, c.symbol)
        singles = [gemv_registry.call(fn, x_all[i:i + 1], w, b) for i in range(33)]
        for m in range(1, 34):
            got = gemv_registry.call(fn, x_all[:m], w, b)
            if got is None:  # declined (the tiles take at most 32 rows): never wrong
                assert m > gemv_registry.MAX_ROWS, (c.name, m)
                continue
            ref = (x_all[:m].double() @ w.double().t()
                   + (b.double() if b is not None else 0.0)).bfloat16()
            d = _ulps_apart(got, ref)
            assert d.max().item() <= 1, (c.name, m)
            assert (d > 0).float().mean().item() <= 0.03, (c.name, m)
            assert torch.equal(got, torch.cat(singles[:m])), (c.name, m)


def test_a_shape_too_busy_to_time_keeps_the_flags_choice_and_is_timed_again(lib):
    calls: list = []

    def preempted(shape, kernels, keep):
        calls.append(shape)
        return None  # measure's answer when every call was preempted

    names = [c.name for c in gemv_choice.available(lib)]
    got = gemv_choice.choose(lib, [(1024, 512)], timer=preempted)
    assert got[(1024, 512)].name == gemv_registry.flag_default(names)
    # the rest of this process keeps that choice (a second model computes with the first's
    # kernels), even where a timing would now pick another
    fast = [n for n in names if n != gemv_registry.flag_default(names)]
    again = gemv_choice.choose(lib, [(1024, 512)], timer=_fake_timer(fast[0], calls)
                               if fast else preempted)
    assert again[(1024, 512)] == got[(1024, 512)] and calls == [(1024, 512)]
    gemv_choice._memo.clear()  # a later process: timed again (nothing was cached for it)
    gemv_choice.choose(lib, [(1024, 512)], timer=preempted)
    assert calls == [(1024, 512)] * 2
    assert gemv_choice.plausible(1e-3, 4 << 20) and not gemv_choice.plausible(20e-3, 4 << 20)
