"""Smoke runs of the benchmark scripts at minimal sizes: they run, print their table, and the
numbers they report are the ones the engine produced (hit rates, exactness on vs off)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = str(Path(__file__).resolve().parents[1])  # benchmarks/ is a package beside pagefold/


@pytest.fixture
def prefix_cache(monkeypatch):
    monkeypatch.syspath_prepend(REPO)
    from benchmarks import prefix_cache

    return prefix_cache


def test_prefix_cache_benchmark_tiny(prefix_cache, qwen3_5_dir, capsys):
    rows = prefix_cache.main([
        "--model", str(qwen3_5_dir), "--threads", "1", "--kv-cache-memory", "16MiB",
        "--max-model-len", "512", "--quiet",
        "--prefix-lens", "8", "40", "--prefix-requests", "3", "--prefix-output-len", "2",
        "--conversations", "2", "--turns", "2", "--answer-len", "4",
        "--split-lens", "64", "24", "--split-requests", "3", "--split-output-len", "2",
        "--random-requests", "3", "--random-input-len", "24", "--random-output-len", "2", "3",
        "--random-repeats", "2",
    ])  # fmt: skip
    names = ["prefix8/seq", "prefix8/batch", "prefix40/seq", "prefix40/batch", "conv 2x2",
             "split 64/24", "random"]
    assert [(r["trace"], r["cache"]) for r in rows] == [(n, c) for n in names
                                                         for c in ("off", "on")]
    by = {(r["trace"], r["cache"]): r for r in rows}

    for n in names:
        off, on = by[n, "off"], by[n, "on"]
        assert off["hit rate"] == 0 and off["reqs hit"] == 0  # nothing is cached with it off
        assert on["reqs"] == off["reqs"] and on["prompt tok"] == off["prompt tok"]
        assert on["match"] == 1.0, n  # float32 greedy: the cache never changes an answer
        assert on["on/off tok/s"] > 0 and on["TTFT ms"] > 0 and off["seconds"] > 0
    assert by["random", "on"]["reqs"] == 6  # two repeats of three fresh prompts
    # A 40-token prefix is two full blocks (32 tokens): from the 2nd sequential request on, at
    # least those blocks can be reused (a hybrid also needs a state checkpoint there).
    assert by["prefix40/seq", "on"]["hit rate"] > 0
    assert by["prefix40/seq", "on"]["reqs hit"] >= 1
    assert by["conv 2x2", "on"]["reqs hit"] == 2  # both second turns reuse their first turn
    assert by["split 64/24", "on"]["reqs hit"] >= 2
    for n in ("prefix8/seq", "prefix8/batch", "random"):  # nothing shareable: no hit
        assert by[n, "on"]["hit rate"] == 0

    table = capsys.readouterr().out
    header = next(line for line in table.splitlines() if "TTFT off/on" in line)
    assert header.split()[:3] == ["trace", "cache", "reqs"]
    for n in names:
        assert sum(line.strip().startswith(n) for line in table.splitlines()) == 2


def test_ttft_zero_overlap_benchmark_tiny(monkeypatch, qwen3_5_dir, nemotron_h_dir, capsys):
    monkeypatch.syspath_prepend(REPO)
    from benchmarks import ttft_zero_overlap

    rows = ttft_zero_overlap.main([
        "--models", str(qwen3_5_dir), str(nemotron_h_dir), "--prompts", "3",
        "--in-len", "40", "70", "--long-out", "1", "--out-len", "3", "--dtype", "float32",
        "--kv-cache-memory", "16MiB", "--max-model-len", "256",
    ])  # fmt: skip
    assert [r["model"] for r in rows] == [qwen3_5_dir.name, nemotron_h_dir.name]
    for r in rows:
        assert r["reqs"] == 3 and 120 <= r["prompt tok"] <= 210
        assert r["hits"] == 0  # zero overlap: nothing to reuse
        assert r["ckpts"] > 0  # but the ON engine took checkpoints (inside the kernels)
        assert r["match"] == 1.0  # float32 greedy: caching never changes an answer
        assert r["TTFT off/on"] > 0 and r["CPU off/on"] > 0 and r["pair med"] > 0
    assert "TTFT off/on" in capsys.readouterr().out
    kern = ttft_zero_overlap.main(["--kernels", "--kernel-len", "300", "--kernel-repeats", "1"])
    assert [r["kernel"] for r in kern] == ["ssd_chunked", "gdn_chunked"]
    assert all(r["captures"] == 3 and r["captures/plain"] > 0 for r in kern)  # 240, 256, 288


def test_serve_compare_pagefold_only(monkeypatch, tmp_path, capsys):
    """The serving comparison starts a real ``pagefold serve``, drives it with the streaming
    client, stops it, and reports what the client measured (vLLM is left out here)."""
    monkeypatch.syspath_prepend(REPO)
    monkeypatch.setenv("PAGEFOLD_CACHE", str(tmp_path))  # the bench model is built here
    from benchmarks import serve_compare

    rows = serve_compare.main(["--archs", "qwen3", "--num-prompts", "4", "--input-len", "16",
                               "--output-len", "3", "--request-rate", "inf"])
    assert [r["system"] for r in rows] == ["pagefold"]
    r = rows[0]
    assert r["out tok/s"] > 0 and r["req/s"] > 0
    assert 0 < r["TTFT ms"] <= r["p99 TTFT"] and 0 < r["TPOT ms"] <= r["p99 TPOT"]
    assert "tok/s /vLLM" not in r
    assert "pagefold" in capsys.readouterr().out


def test_serve_client_splits_sse_lines_at_newlines_only(monkeypatch):
    """Completion text may carry U+2028 / U+0085 unescaped inside a JSON string (vLLM's server
    does): the client must not cut a ``data:`` line there, even across network chunks."""
    import asyncio

    import httpx

    monkeypatch.syspath_prepend(REPO)
    from benchmarks.serve import _sse_lines

    body = 'data: {"t": "a\u2028b\x85c"}\r\n\r\ndata: [DONE]\n\n'.encode()

    class Chunks(httpx.AsyncByteStream):
        async def __aiter__(self):
            for i in range(0, len(body), 5):  # a multi-byte character split across chunks
                yield body[i : i + 5]

    async def lines():
        return [line async for line in _sse_lines(httpx.Response(200, stream=Chunks()))]

    got = asyncio.run(lines())
    assert [x for x in got if x] == ['data: {"t": "a\u2028b\x85c"}', "data: [DONE]"]


def test_model_pass_products_benchmark_tiny(monkeypatch, capsys):
    monkeypatch.syspath_prepend(REPO)
    from benchmarks import model_pass_products
    from pagefold.csrc import cpu_ops

    if cpu_ops.kernels() is None:
        pytest.skip("no C++ compiler")
    model_pass_products.main(["--layers", "1", "--rows", "1", "33", "--reps", "1"])
    lines = capsys.readouterr().out.splitlines()
    names = lines[1].split()
    assert names[0] == "M" and names[-1] == "F.linear"
    # oneDNN's packed bf16 weights exist only with AVX512 / AVX-NE-CONVERT: a column then.
    packs = cpu_ops.prepack(torch.zeros(8, 8, dtype=torch.bfloat16)) is not None
    assert ("onednn" in names) == packs
    rows = {ln.split()[0]: ln.split()[1:] for ln in lines[2:]}
    assert set(rows) == {"1", "33"}
    assert all(float(v) > 0 for v in rows["1"])  # every product times one row
    if "amx" in names:  # the tile kernel stops at 32 rows
        assert rows["33"][names.index("amx") - 1] == "-"


def test_compare_kills_a_workers_process_group_when_terminated(tmp_path):
    """benchmarks.compare's workers run in their own process group, taken down when compare is
    terminated: vLLM's engine core outlived its parent and loaded later measurements."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "grandchild.pid"
    worker = (f"import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    parent = (f"import sys; sys.path.insert(0, {REPO!r}); import signal; "
              "from benchmarks import compare; "
              "signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)); "
              f"compare.run_group([sys.executable, '-c', {worker!r}], None, None)")
    proc = subprocess.Popen([sys.executable, "-c", parent])
    for _ in range(200):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 143
    for _ in range(100):  # killed: gone, or a zombie until init reaps it
        try:
            state = Path(f"/proc/{grandchild}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        os.kill(grandchild, signal.SIGKILL)
        raise AssertionError("the worker's child survived its terminated parent")


def test_decode_attention_benchmark_tiny(monkeypatch, capsys):
    """One small shape: the kernel ran (the script asserts each call was taken) and the
    table reports a positive read rate."""
    from pagefold.csrc import cpu_ops

    if cpu_ops.kernels() is None:
        pytest.skip("no C++ compiler")
    monkeypatch.syspath_prepend(REPO)
    from benchmarks import decode_attention

    monkeypatch.setattr(decode_attention, "SHAPES", [("tiny", 2, 40, 4, 2, 64)])
    rows = decode_attention.main(["--layers", "2", "--repeats", "1", "--threads", "1"])
    assert [r["shape"] for r in rows] == ["tiny"]
    assert rows[0]["GB/s"] > 0 and rows[0]["vs copy"] > 0
    assert "GB/s" in capsys.readouterr().out
