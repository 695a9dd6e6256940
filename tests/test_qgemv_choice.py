"""The GGUF product chooser (``quantization/qgemv_choice``): which kernel bf16 rows take and
up to how many rows, decided from fake timing tables (no test depends on real timings); the
cache file (a later choice reads it, no timing); the ``PAGEFOLD_QGEMV`` modes; the streamed
twins it times on; and a weight's product following its choice, on the module path and in the
native driver's record."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pagefold.csrc import cpu_ops, gemv_choice
from pagefold.csrc.gemv_choice import ROWS
from pagefold.quantization import qgemv_choice
from pagefold.quantization.gguf_kernel import GGUFWeight

sys.path.insert(0, str(Path(__file__).parent))
from gguf_files import _k_blocks  # noqa: E402

lib = cpu_ops.kernels()
pytestmark = pytest.mark.skipif(lib is None, reason="no compiled kernels")


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEFOLD_CACHE", str(tmp_path))
    monkeypatch.delenv("PAGEFOLD_QGEMV", raising=False)
    monkeypatch.setattr(gemv_choice, "_memo", {})


def _weight(kind: str, n: int, k: int, seed: int = 0) -> GGUFWeight:
    rng = np.random.default_rng(seed)
    if kind.endswith("_K"):  # gguf-py cannot quantize K types: random blocks
        raw = _k_blocks(kind, n, k, rng).reshape(n, -1)
    else:
        w = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
    return GGUFWeight([(kind, torch.from_numpy(raw))], k)


def _dense(weight: GGUFWeight) -> torch.Tensor:
    """The weight decoded from its own arrays in the test (codes * scale + min)."""
    c = weight.codes
    if weight.bits == 4:  # GGUF order per group of 32: low nibbles, then high nibbles
        b = c.reshape(c.shape[0], -1, 1, 16)
        c = torch.cat([b & 15, b >> 4], dim=2).reshape(c.shape[0], -1)
    q = c.float().reshape(weight.n, -1, weight.group)
    w = q * weight.scale.float()[..., None] + weight.min.float()[..., None]
    return w.reshape(weight.n, weight.k)


def _timer(fastest: str, kernel_rows: int, calls: list):
    """A fake timing: ``fastest`` at 10 us a row, the other kernel at 40; the tile path flat,
    just above ``fastest`` at ``kernel_rows`` rows (so the chosen rows are ``kernel_rows``)."""
    def timer(proto, stream, kernels):
        calls.append(((proto.n, proto.k), list(kernels)))
        table = {name: {r: (10.0 if name == fastest else 40.0) * r for r in ROWS}
                 for name in kernels}
        return table, dict.fromkeys(ROWS, 10.0 * kernel_rows + 15)
    return timer


def test_choose_takes_the_measured_kernel_and_rows_then_reads_the_cache():
    big = [_weight("Q4_1", 1024, 512, s) for s in range(2)]  # one shape, two weights
    other = _weight("Q4_1", 512, 1024)
    small = _weight("Q4_1", 32, 64)  # too small to time: the flags' choice
    calls: list = []
    n = qgemv_choice.choose(big + [other, small, big[0]], timer=_timer("float", 8, calls))
    assert n == 4
    assert all(w.choice == ("float", 8) for w in big + [other])
    assert small.choice == qgemv_choice.flags_pick(small)
    # one timing per shape, twice each (a change from the flags' choice is confirmed)
    assert sorted(c[0] for c in calls) == [(512, 1024)] * 2 + [(1024, 512)] * 2
    assert calls[0][1][0] == qgemv_choice.flags_pick(other)[0]
    files = list((gemv_choice.cache_path({"x": 1}).parent).glob("choice-*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert data["key"]["weights"] == "gguf b4 g32 float16"
    assert data["shapes"]["1024x512"] == {"kernel": "float", "rows": 8,
                                          "us": data["shapes"]["1024x512"]["us"]}
    # a later load reads the file: no timing, the same choice
    gemv_choice._memo.clear()
    again = [_weight("Q4_1", 1024, 512, 5)]
    later: list = []
    qgemv_choice.choose(again, timer=_timer("q8", 32, later))
    assert later == [] and again[0].choice == ("float", 8)


def test_a_choice_within_the_margin_keeps_the_flags_kernel():
    w = _weight("Q4_1", 1024, 512)
    flags = qgemv_choice.flags_pick(w)
    if flags[0] == "float":
        pytest.skip("no int8-activation form here: one kernel, nothing to choose")

    def timer(proto, stream, kernels):
        return ({name: dict.fromkeys(ROWS, 10.0 if name == flags[0] else 9.5)
                 for name in kernels}, dict.fromkeys(ROWS, math.inf))
    qgemv_choice.choose([w], timer=timer)
    assert w.choice == flags


@pytest.mark.parametrize("mode,want", [("float", ("float", 32)), ("tile", ("torch", 0))])
def test_modes_force_without_timing(monkeypatch, mode, want):
    monkeypatch.setenv("PAGEFOLD_QGEMV", mode)
    w = _weight("Q4_1", 1024, 512)
    qgemv_choice.choose([w], timer=lambda *a: pytest.fail("timed a forced choice"))
    assert w.choice == want


def test_flags_mode_and_a_bad_mode(monkeypatch):
    monkeypatch.setenv("PAGEFOLD_QGEMV", "flags")
    w = _weight("Q4_1", 1024, 512)
    qgemv_choice.choose([w], timer=lambda *a: pytest.fail("timed the flags' choice"))
    takes = bool(lib.pf_qgemv_q8_takes(4, 32))
    tiles = takes and bool(lib.pf_qgemm_q8_takes(4, 32))
    assert w.choice == (("q8mm" if tiles else "q8" if takes else "float"), 32)
    monkeypatch.setenv("PAGEFOLD_QGEMV", "fastest")
    with pytest.raises(ValueError, match="PAGEFOLD_QGEMV='fastest': expected one of auto"):
        qgemv_choice.choose([_weight("Q4_1", 1024, 512)])


def test_twins_stream_over_every_weight_of_the_signature():
    ws = [_weight("Q4_1", 64, 128, s) for s in range(3)] + [_weight("Q4_1", 256, 128, 9)]
    stream = qgemv_choice.WeightStream(ws)
    proto = ws[0]
    seen = []
    for _ in range(8):
        t = stream.next(proto, 64)
        assert (t.n, t.k, t.bits, t.group) == (64, 128, 4, 32)
        seen.append((t.codes.data_ptr(), t.scale.data_ptr(), t.min.data_ptr()))
        # a twin's product is the product of its own arrays' weights
        x = torch.randn(3, 128)
        ref = x.double() @ _dense(t).double().T
        assert torch.allclose(t.product(x, "float").double(), ref, atol=1e-4)
    assert len(set(seen)) == 7  # 3 small sources, the large one holds 4 views; then round again
    for i, (c, _, _) in enumerate(seen[:7]):
        src = ws[min(i, 3)]
        assert src.codes.data_ptr() <= c < src.codes.data_ptr() + src.codes.numel()


def test_products_follow_the_choice_on_both_paths():
    w = _weight("Q4_1", 96, 128)
    w.choice = ("float", 4)
    x = torch.randn(6, 128).bfloat16()
    # at most 4 rows: the float kernel's bits; above: decoded bf16 tiles times x (the bf16
    # GEMV's or oneDNN's float32 sums: equal to rounding)
    assert torch.equal(w.matmul(x[:4]), w.product(x[:4], "float").bfloat16())
    tiles = torch.nn.functional.linear(x[:5].float(), _dense(w).bfloat16().float())
    torch.testing.assert_close(w.matmul(x[:5]).float(), tiles, rtol=8e-3, atol=1e-3)
    big = _weight("Q4_1", 600, 128)  # more than one few-row tile: every tile lands
    big.choice = ("float", 1)
    want = torch.nn.functional.linear(x[:3].float(), _dense(big).bfloat16().float())
    torch.testing.assert_close(big.matmul(x[:3]).float(), want, rtol=8e-3, atol=1e-3)
    if lib.pf_qgemv_q8_takes(4, 32):
        q = _weight("Q4_1", 96, 128)
        q.choice = ("q8", 32)
        assert torch.equal(q.matmul(x), q.product(x, "q8").bfloat16())
        assert not torch.equal(q.product(x, "q8"), q.product(x, "float"))
    # float32 rows always take the float kernel, whatever was chosen for bf16
    xf = torch.randn(6, 128)
    assert torch.equal(w.matmul(xf), w.product(xf, "float"))
    w.choice = ("torch", 0)
    assert w.native() is None


def _int_weight(n: int, k: int, group: int = 32, seed: int = 0):
    """A GPTQ 4-bit weight of random codes and the float32 weight it stands for (decoded
    here: ``scale * (code - zero)`` per group)."""
    from pagefold.quantization.formats import GPTQ
    from pagefold.quantization.int_kernel import IntWeight

    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(1, 16, (k // group, n), generator=gen)
    s = torch.rand(k // group, n, generator=gen).half() * 0.1 + 0.01
    g = torch.arange(k) // group
    dense = (s[g].float() * (q - z[g]).float()).t().contiguous()

    def pack(vals: torch.Tensor) -> torch.Tensor:  # along rows, 8 codes to an int32 word
        words = torch.zeros(vals.shape[0] // 8, vals.shape[1], dtype=torch.int64)
        for i in range(vals.shape[0]):
            words[i // 8] += vals[i] << (4 * (i % 8))
        words %= 1 << 32
        return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)

    t = {"qweight": pack(q), "qzeros": pack((z - 1).t()).t().contiguous(), "scales": s,
         "g_idx": g.to(torch.int32)[None]}
    return IntWeight(GPTQ(4, group, sym=False), t, {"": (0, n)}, n, k), dense


def test_integer_weights_join_the_table_under_their_own_signature():
    iw, dense = _int_weight(1024, 512)
    gg = _weight("Q4_1", 1024, 512)
    calls: list = []
    qgemv_choice.choose([iw, gg], timer=_timer("int", 4, calls))
    # its one kernel, up to 8 rows: the tile path wins from 8 rows, but not by the native
    # decode driver's cost of leaving it (gemv_choice.DRIVER_COST)
    assert iw.choice == ("int", 8)
    assert sorted(set(ks[0] for _, ks in calls)) == sorted({"int", gg.kernel_names()[0]})
    assert iw.signature() == "int b4 g32" and gg.signature() != iw.signature()
    x = torch.randn(10, 512).bfloat16()
    assert torch.equal(iw.matmul(x[:8]), iw.product(x[:8], "int"))
    torch.testing.assert_close(iw.matmul(x[:9]).float(),
                               x[:9].float() @ dense.bfloat16().float().T, rtol=8e-3, atol=1e-3)
    iw.choice = ("torch", 0)
    assert iw.native() is None


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_compiled_tile_decode_is_the_torch_decode_in_bf16(kind):
    """``pf_affine_decode_bf16`` (the tile path's decode) gives the bits of the weight decoded
    here in float32 (product, then sum: never fused) and rounded to bf16; a tile not at row 0
    reads its own rows; arguments it does not take are refused with nothing written."""
    w = _weight(kind, 70, 512, seed=3)
    want = _dense(w).bfloat16()
    for r0, r1 in ((0, 70), (13, 41)):
        out = torch.full((r1 - r0, 512), 7.0, dtype=torch.bfloat16)
        rc = lib.pf_affine_decode_bf16(
            w.codes[r0].data_ptr(), w.bits, w.group, w.scale[r0].data_ptr(),
            w.min[r0].data_ptr(), int(w.scale.dtype == torch.float16), r1 - r0, 512,
            out.data_ptr(), 512, 2)
        assert rc == 0
        assert torch.equal(out.view(torch.int16), want[r0:r1].view(torch.int16))
    out = torch.full((70, 512), 7.0, dtype=torch.bfloat16)
    assert lib.pf_affine_decode_bf16(w.codes.data_ptr(), w.bits, 48, w.scale.data_ptr(),
                                     w.min.data_ptr(), 0, 70, 512, out.data_ptr(), 512, 2) == 1
    assert torch.all(out == 7.0)


def test_a_kernel_that_declines_the_layout_keeps_the_flags_choice():
    """Measuring a weight whose kernel refuses its layout gives no table (the load goes on
    and the weight keeps the flags' choice and its run-time fallback), never an error."""
    w = _weight("Q4_1", 1024, 512)
    w.product = lambda x, name: None  # every kernel declines
    stream = qgemv_choice.WeightStream([w])
    assert qgemv_choice.measure(w, stream, w.kernel_names()) is None
    qgemv_choice.choose([w])
    assert w.choice == qgemv_choice.flags_pick(w)


def test_the_tile_kernel_is_chosen_when_the_timings_say_so(monkeypatch):
    """``q8mm`` (AMX tiles, on CPUs with AMX-INT8) joins the table where it runs, first (the
    flags' pick): kept at all 32 rows when its fake times win, the GEMV when its do; forced by
    ``PAGEFOLD_QGEMV=q8mm``; elsewhere the weight does not list it and the mode falls back to
    the flags' pick."""
    w = _weight("Q4_1", 1024, 512)
    names = w.kernel_names()
    if "q8mm" not in names:
        assert not lib.pf_qgemm_q8_takes(4, 32)
        monkeypatch.setenv("PAGEFOLD_QGEMV", "q8mm")
        qgemv_choice.choose([w], timer=lambda *a: pytest.fail("timed a forced choice"))
        assert w.choice == qgemv_choice.flags_pick(w)
        return
    assert names[:2] == ["q8mm", "q8"]  # the flags' pick: tiles where the CPU has them
    calls: list = []
    qgemv_choice.choose([w], timer=_timer("q8mm", 32, calls))
    assert w.choice == ("q8mm", 32) and calls[0][1] == names
    gemv = _weight("Q4_1", 2048, 512, 2)  # the GEMV when the timings say so (another shape)
    qgemv_choice.choose([gemv], timer=_timer("q8", 32, calls))
    assert gemv.choice == ("q8", 32)
    assert w.native() is not None
    x = torch.randn(20, 512).bfloat16()
    assert torch.equal(w.matmul(x), w.product(x, "q8mm").bfloat16())
    other = _weight("Q4_1", 1024, 512, 1)
    monkeypatch.setenv("PAGEFOLD_QGEMV", "q8mm")
    qgemv_choice.choose([other], timer=lambda *a: pytest.fail("timed a forced choice"))
    assert other.choice == ("q8mm", 32)
