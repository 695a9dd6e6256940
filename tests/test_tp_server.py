"""``pagefold serve --tensor-parallel-size 2`` (or ``--pipeline-parallel-size 2``) when a
worker rank dies: the engine core ends with an error naming the rank, the request in flight and
every later one get an OpenAI-style 503, ``/health`` says dead, and stopping the server leaves
no process behind (ranks included). Under pipeline parallelism the first stage's rank is
killed: the last stage, waiting for its hidden states, must not hang the engine.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from test_server import HEADERS, MODEL, Server, _alive, _children, _wait_until

pytestmark = pytest.mark.slow


def _worker_ranks(core_pid: int) -> dict[int, int]:
    """rank -> pid of the core's tensor-parallel workers (``pagefold.distributed.worker``)."""
    ranks = {}
    for pid in _children(core_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except FileNotFoundError:
            continue
        if b"pagefold.distributed.worker" in argv:
            i = argv.index(b"pagefold.distributed.worker")
            ranks[int(argv[i + 2])] = pid
    return ranks


@pytest.mark.parametrize(("flag", "killed"), [("--tensor-parallel-size", 1),
                                              ("--pipeline-parallel-size", 0)])
def test_killed_rank_gives_503_never_a_hang(llama_dir, tmp_path, flag, killed):
    srv = Server.launch(llama_dir, tmp_path / "server.log", extra_args=(
        flag, "2", "--threads-per-rank", "1", "--no-warm-up"))
    try:
        srv.ready(timeout=180)
        body = {"model": MODEL, "prompt": "hello there", "max_tokens": 4, "ignore_eos": True}
        r = srv.post("/v1/completions", body)
        assert r.status_code == 200, r.text  # served by both ranks
        ranks = _wait_until(lambda: (lambda d: d if len(d) == 2 else None)(
            _worker_ranks(srv.core_pid)), 10)
        assert ranks and set(ranks) == {0, 1}, ranks
        os.kill(ranks[killed], signal.SIGKILL)
        t = time.monotonic()
        r = srv.post("/v1/completions", dict(body, max_tokens=50))
        assert time.monotonic() - t < 20
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "engine_unavailable", err
        assert f"rank {killed}" in err["message"], err  # the engine error names the dead rank
        h = httpx.get(srv.url + "/health", timeout=10)
        assert h.status_code == 503 and h.json()["status"] == "dead"
        r = httpx.post(srv.url + "/v1/completions", json=body, headers=HEADERS, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        # The core's other rank does not outlive it.
        assert _wait_until(lambda: not _alive(ranks[1 - killed]), 15), "a rank left behind"
    finally:
        srv.stop()
