"""A bounded soak of ``pagefold serve`` on loopback (issue 16, item 9).

For ``SOAK_SECONDS`` (40 by default; ``PAGEFOLD_SOAK_SECONDS`` overrides) a dozen clients
send a random mix: non-streaming and streaming completions and chats, ``n`` = 2 families,
clients that disconnect mid-stream or abandon a non-streaming request, prompts that share
prefixes (prefix hits), all against a pool far too small for the load (preemption by swap
and recompute). Greedy requests are compared with the same request served alone before the
load started. At the end:

* the pool is whole (the core's ``check_whole``), nothing runs or waits, nothing is in flight
  in the API process;
* every request is accounted for: each got a complete answer, an OpenAI-style error, or was
  abandoned by its client, and the server's ``request_success_total`` (every finish reason,
  aborts included) equals the requests it accepted;
* preemptions and prefix hits happened; no 500 and no traceback in the log;
* the API process's RSS is within a bound of its value after warm-up.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter

import httpx
import pytest
from test_server import HEADERS, MODEL, Server

from pagefold.testing.tiny_models import random_prompts

SOAK_SECONDS = float(os.environ.get("PAGEFOLD_SOAK_SECONDS", "40"))
CLIENTS = 12
MAX_MODEL_LEN = 128


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _metric_sum(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))


@pytest.mark.slow
def test_soak(qwen3_dir, tmp_path):
    # 312 KiB: 12 usable blocks of 16 tokens for a dozen clients of up to 128 tokens.
    srv = Server.launch(qwen3_dir, tmp_path / "soak.log", kv_cache_memory="312KiB",
                        extra_args=("--max-model-len", str(MAX_MODEL_LEN), "--swap-space",
                                    "1MiB", "--preemption-mode", "auto",
                                    "--state-checkpoint-interval", "32"))
    try:
        srv.ready(timeout=300)
        _soak(srv)
    finally:
        srv.stop()
    log = srv.log.read_text()
    assert "Traceback" not in log, log[-4000:]


def _soak(srv: Server) -> None:
    rng = random.Random(16)
    prefixes = random_prompts(3, 32, 32, 512, seed=160)
    tails = random_prompts(8, 4, 20, 512, seed=161)
    prompts = [p + t for p in prefixes for t in tails]
    greedy = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    url = srv.url

    # Solo references for the greedy requests checked under load.
    with httpx.Client(timeout=60, headers=HEADERS) as c:
        ref = {}
        for i in range(0, len(prompts), 5):
            r = c.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompts[i],
                                                      **greedy})
            assert r.status_code == 200, r.text
            ref[i] = r.json()["choices"][0]["text"]
    accepted_before = _metric_sum(httpx.get(url + "/metrics", headers=HEADERS).text,
                                  "pagefold:request_success_total")
    rss_start = _rss_mib(srv.proc.pid)
    outcomes: Counter = Counter()
    accepted = 0
    problems: list[str] = []

    async def one(c: httpx.AsyncClient) -> None:
        nonlocal accepted
        i = rng.randrange(len(prompts))
        kind = rng.choice(["plain", "plain", "stream", "stream", "leave_stream",
                           "abandon", "chat_stream", "n2"])
        body: dict = {"model": MODEL, "prompt": prompts[i], "max_tokens": rng.randint(4, 40),
                      "temperature": 0.8, "seed": rng.randrange(1000)}
        if kind == "plain" and i in ref:
            body.update(greedy)
        if kind == "n2":
            body.update(n=2)
        if kind == "chat_stream":
            path = "/v1/chat/completions"
            body.pop("prompt")
            body["messages"] = [{"role": "user", "content": f"soak {i} " * rng.randint(1, 6)}]
        else:
            path = "/v1/completions"
        body["stream"] = kind in ("stream", "leave_stream", "chat_stream")
        if kind == "abandon":
            task = asyncio.ensure_future(c.post(url + path, json=body))
            await asyncio.sleep(rng.uniform(0.0, 0.4))
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                outcomes["abandoned"] += 1  # may or may not have reached the engine
                return
            r = task.result()
            accepted += r.status_code == 200
            outcomes[f"abandon_{r.status_code}"] += 1
            return
        if not body["stream"]:
            r = await c.post(url + path, json=body)
            if r.status_code != 200:
                problems.append(f"{kind}: {r.status_code} {r.text[:200]}")
                return
            accepted += 1
            data = r.json()
            if "temperature" in body and body["temperature"] == 0 and i in ref:
                if data["choices"][0]["text"] != ref[i]:
                    problems.append(f"greedy prompt {i} differs under load")
            expect = body.get("n", 1)
            if len(data["choices"]) != expect:
                problems.append(f"{kind}: {len(data['choices'])} choices")
            outcomes[kind] += 1
            return
        leave_after = rng.randint(1, 4) if kind == "leave_stream" else None
        async with c.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                problems.append(f"{kind}: {r.status_code} {(await r.aread())[:200]!r}")
                return
            accepted += 1
            events = 0
            last = None
            async for line in r.aiter_lines():
                if not line:
                    continue
                last = line
                events += 1
                if line.startswith("data: {") and '"error"' in line:
                    problems.append(f"{kind}: in-band error {line[:200]}")
                if leave_after is not None and events >= leave_after:
                    outcomes["left_stream"] += 1
                    return  # closing the stream disconnects
            if last != "data: [DONE]":
                problems.append(f"{kind}: stream ended with {last!r}")
            outcomes[kind] += 1

    async def client_loop(deadline: float) -> None:
        async with httpx.AsyncClient(timeout=120, headers=HEADERS) as c:
            while time.monotonic() < deadline:
                await one(c)

    async def run() -> None:
        deadline = time.monotonic() + SOAK_SECONDS
        await asyncio.gather(*(client_loop(deadline) for _ in range(CLIENTS)))

    asyncio.run(run())
    assert not problems, problems[:10]
    pool = srv.wait_pool_whole(timeout=15)
    assert pool["num_free_blocks"] == pool["num_usable_blocks"]
    assert httpx.get(url + "/health").json()["num_in_flight"] == 0
    assert pool["num_preemptions"] > 0 and pool["prefix_hits"] > 0, pool
    metrics = httpx.get(url + "/metrics", headers=HEADERS).text
    finished = _metric_sum(metrics, "pagefold:request_success_total") - accepted_before
    # Each accepted request finished exactly once (aborts included); an abandoned request
    # counts once if it had reached the engine before its client left.
    assert accepted <= finished <= accepted + outcomes["abandoned"], (finished, accepted,
                                                                      outcomes)
    total = sum(outcomes.values())
    assert total > 50 and outcomes["abandoned"] + outcomes["left_stream"] > 0, outcomes
    time.sleep(1.5)  # idle: freed memory is handed back
    rss_end = _rss_mib(srv.proc.pid)
    print(f"soak: {total} requests {dict(outcomes)}, preemptions {pool['num_preemptions']}, "
          f"prefix hit rate {pool['prefix_hit_rate']:.2f}, API RSS {rss_start:.0f} -> "
          f"{rss_end:.0f} MiB")
    assert rss_end < rss_start + 40, (rss_start, rss_end)
    json.dumps(pool)  # the admin view stays serialisable
