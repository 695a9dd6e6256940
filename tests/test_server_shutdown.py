"""Graceful shutdown of ``pagefold serve`` (SIGTERM under load) and a busy port.

The server runs with ``--shutdown-timeout 2`` and one sequence at a time, so requests queued
behind a long one cannot finish inside the drain: they must be ended with an OpenAI-style 503
(non-streaming) or an SSE error event and ``[DONE]`` (streaming), while a short request that
was running finishes normally and new requests get 503 at once.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import httpx
from test_server import HEADERS, MODEL, Server

TIMEOUT = 2.0


def _long(stream: bool) -> dict:
    return {"model": MODEL, "prompt": "to be continued", "max_tokens": 4000, "ignore_eos": True,
            "stream": stream}


def test_sigterm_drains_then_ends_everyone_properly(qwen3_dir, tmp_path):
    srv = Server.launch(qwen3_dir, tmp_path / "server.log", extra_args=(
        "--shutdown-timeout", str(TIMEOUT), "--max-num-seqs", "1", "--max-model-len", "4096"))
    srv.ready(timeout=300)

    async def scenario() -> dict:
        out: dict = {}
        async with httpx.AsyncClient(timeout=60, headers=HEADERS) as c:
            async def stream_one(key: str) -> None:
                async with c.stream("POST", srv.url + "/v1/completions",
                                    json=_long(True)) as r:
                    out[key + "_status"] = r.status_code
                    out[key] = [line async for line in r.aiter_lines() if line]

            async def post(key: str, body: dict) -> None:
                r = await c.post(srv.url + "/v1/completions", json=body)
                out[key] = (r.status_code, r.json())

            short = asyncio.create_task(post("short", {"model": MODEL, "prompt": "hi",
                                                       "max_tokens": 4}))
            await short  # finished before the signal
            tasks = [asyncio.create_task(stream_one("stream"))]
            for _ in range(3000):  # the first stream is generating (its headers are out)
                if "stream_status" in out:
                    break
                await asyncio.sleep(0.02)
            tasks += [asyncio.create_task(post("blocking", _long(False))),
                      asyncio.create_task(stream_one("queued_stream"))]
            await asyncio.sleep(0.5)  # both queued behind it (one sequence at a time)
            out["t_signal"] = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            r = await c.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
            out["late"] = (r.status_code, r.json())
            r = await c.get(srv.url + "/health")
            out["health"] = (r.status_code, r.json())
            await asyncio.gather(*tasks)
        return out

    try:
        out = asyncio.run(scenario())
        srv.proc.wait(TIMEOUT + 10)
        exited = time.monotonic()
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    assert out["short"][0] == 200
    status, body = out["late"]
    assert status == 503 and body["error"]["code"] == "server_shutting_down", body
    assert out["health"][0] == 503 and out["health"][1]["status"] == "draining"
    status, body = out["blocking"]
    assert status == 503 and body["error"]["type"] == "server_error", body
    assert "shutting down" in body["error"]["message"]
    lines = out["stream"]  # headers were out: an in-band error event, then [DONE]
    assert out["stream_status"] == 200
    assert lines[-1] == "data: [DONE]", lines[-3:]
    err = json.loads(lines[-2][len("data: "):])
    assert "shutting down" in err["error"]["message"], lines[-3:]
    # a stream still queued has sent nothing yet (streams are primed): a real 503
    assert out["queued_stream_status"] == 503
    assert "shutting down" in json.loads(out["queued_stream"][0])["error"]["message"]
    assert exited - out["t_signal"] < TIMEOUT + 2 + 1.0  # +1: this test's own polling
    assert srv.proc.returncode == 0
    log = srv.log.read_text()
    assert "Traceback" not in log and "Cancel" not in log, log[-3000:]


def test_busy_port_fails_before_the_model_loads(qwen3_dir, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "pagefold.entrypoints.cli", "serve", str(qwen3_dir),
             "--port", str(port)], capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr
    assert f"127.0.0.1:{port}" in proc.stderr and "--port" in proc.stderr
    assert "EngineCore" not in proc.stderr  # no engine process was started
    assert took < 60  # imports only (seconds on a loaded machine); no model, no engine
