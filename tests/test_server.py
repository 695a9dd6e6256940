"""End-to-end tests of ``pagefold serve``: a real server process (API process + EngineCore
process) on 127.0.0.1, driven with the official ``openai`` client and raw ``httpx``.

One server serves most tests (module scope); a second one exists only to have its engine core
killed. Both are stopped with SIGTERM and must leave no process behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from pagefold.testing.tiny_models import random_prompts

KEY = "test-key"
MODEL = "tiny"
MAX_MODEL_LEN = 256
HEADERS = {"Authorization": f"Bearer {KEY}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_until(cond, timeout: float, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(step)
    return cond()


def _children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (from /proc)."""
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(d))
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                pass
    return kids


@dataclass
class Server:
    """A ``pagefold serve`` process, launched at once; :meth:`ready` waits for /health."""

    proc: subprocess.Popen
    url: str
    log: Path
    core_pid: int = 0

    @classmethod
    def launch(cls, model_dir: Path, log: Path, *, kv_cache_memory: str = "8MiB",
               extra_args: tuple[str, ...] = ()) -> Server:
        port = _free_port()
        cmd = [sys.executable, "-m", "pagefold.entrypoints.cli", "serve", str(model_dir),
               "--port", str(port), "--served-model-name", MODEL, "--api-key", KEY,
               "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", kv_cache_memory,
               "--uvicorn-log-level", "warning", *extra_args]
        # Keep-alive far past any pause between a test's requests: at uvicorn's 5 s a pooled
        # connection can close just as the client reuses it (ECONNRESET, seen on slow CI hosts).
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   PAGEFOLD_HTTP_TIMEOUT_KEEP_ALIVE="600")
        f = open(log, "w")  # noqa: SIM115 - the server process keeps writing to it
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        return cls(proc, f"http://127.0.0.1:{port}", log)

    def ready(self, timeout: float = 90.0) -> Server:
        deadline = time.monotonic() + timeout
        while not self.core_pid and time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n"
                            f"{self.log.read_text()[-3000:]}")
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if r.status_code == 200:
                    self.core_pid = r.json()["engine_core_pid"]
            except httpx.TransportError:
                time.sleep(0.2)
        if not self.core_pid:
            pytest.fail(f"server not healthy within {timeout} s:\n{self.log.read_text()[-3000:]}")
        return self

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, headers=HEADERS, timeout=30, **kw)

    def post(self, path: str, body, **kw) -> httpx.Response:
        data = body if isinstance(body, str | bytes) else json.dumps(body)
        return httpx.post(self.url + path, content=data, timeout=30,
                          headers=kw.pop("headers", HEADERS), **kw)

    def pool(self) -> dict:
        r = self.get("/v1/admin/pool")
        assert r.status_code == 200, r.text
        return r.json()

    def wait_pool_whole(self, timeout: float = 5.0) -> dict:
        def whole():
            p = self.pool()
            return p if p["whole"] and p["num_running"] == p["num_waiting"] == 0 else None
        pool = _wait_until(whole, timeout)
        assert pool, f"pool not whole after {timeout} s: {self.pool()}"
        return pool

    def stop(self) -> None:
        """SIGTERM; the server and every child of it must be gone within seconds."""
        kids = set(_children(self.proc.pid)) | ({self.core_pid} if self.core_pid else set())
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                pytest.fail(f"server ignored SIGTERM; log:\n{self.log.read_text()[-3000:]}")
        left = _wait_until(lambda: not any(_alive(k) for k in kids), 10)
        assert left, f"processes left behind: {[k for k in kids if _alive(k)]}"


@pytest.fixture(scope="module")
def servers(qwen3_dir, tmp_path_factory):
    """The main server and the one whose engine core a test kills, launched together; the
    offline reference LLM loads in this process meanwhile (the three startups overlap).
    Teardown SIGTERMs both servers and checks that no process is left."""
    from pagefold import LLM

    d = tmp_path_factory.mktemp("server")
    main = Server.launch(qwen3_dir, d / "main.log")
    doomed = Server.launch(qwen3_dir, d / "doomed.log")
    try:
        llm = LLM(str(qwen3_dir), max_model_len=MAX_MODEL_LEN, kv_cache_memory="8MiB")
        yield {"main": main, "doomed": doomed, "llm": llm}
    finally:
        for srv in (main, doomed):
            srv.stop()


@pytest.fixture(scope="module")
def server(servers) -> Server:
    return servers["main"].ready()


@pytest.fixture(scope="module")
def offline_llm(servers):
    return servers["llm"]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


# ----------------------------------------------------------------------------- basics
def test_health_models_version_metrics(server):
    h = httpx.get(server.url + "/health").json()  # no key needed outside /v1
    assert h["status"] == "ok" and h["engine_core_pid"] == server.core_pid
    assert _alive(server.core_pid) and server.core_pid != server.proc.pid
    models = server.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert "version" in server.get("/version").json()
    assert httpx.get(server.url + "/version").status_code == 401  # every route has the key
    text = httpx.get(server.url + "/metrics").text
    for name in ("pagefold:num_requests_running", "pagefold:num_requests_waiting",
                 "pagefold:kv_cache_usage_perc", "pagefold:kv_cache_group_usage_perc",
                 "pagefold:prefix_cache_queries_total", "pagefold:prefix_cache_hits_total",
                 "pagefold:num_preemptions_total", "pagefold:time_to_first_token_seconds",
                 "pagefold:inter_token_latency_seconds", "pagefold:e2e_request_latency_seconds",
                 "pagefold:prompt_tokens_total", "pagefold:generation_tokens_total",
                 "pagefold:num_forks_total", "pagefold:num_preemptions_by_kind_total",
                 "pagefold:swap_out_bytes_total", "pagefold:swap_in_bytes_total",
                 "pagefold:recomputed_tokens_total", "pagefold:recompute_credited_tokens_total",
                 "pagefold:state_checkpoints", "pagefold:state_checkpoint_bytes",
                 "pagefold:prefix_cache_requests_hit_total", "pagefold:prefix_cache_hit_rate"):
        assert name in text, name


def test_keep_alive_outlasts_uvicorns_default(server, monkeypatch):
    """The launch helper sets $PAGEFOLD_HTTP_TIMEOUT_KEEP_ALIVE=600: one connection idle past
    uvicorn's 5 s default is still the same socket, so a pooled client (httpx drops its own idle
    connections at 5 s too) cannot race the server's close."""
    with httpx.Client(base_url=server.url, limits=httpx.Limits(keepalive_expiry=60)) as c:
        assert c.get("/health").status_code == 200
        sock = c.get("/health").extensions["network_stream"].get_extra_info("socket")
        time.sleep(6)
        again = c.get("/health")
        assert again.status_code == 200
        assert again.extensions["network_stream"].get_extra_info("socket") is sock

    from pagefold.entrypoints.openai.server import KEEP_ALIVE_ENV, keep_alive_seconds

    monkeypatch.delenv(KEEP_ALIVE_ENV, raising=False)
    assert keep_alive_seconds() == 5
    for bad in ("0", "-3", "1.5", "soon"):
        monkeypatch.setenv(KEEP_ALIVE_ENV, bad)
        with pytest.raises(SystemExit, match="PAGEFOLD_HTTP_TIMEOUT_KEEP_ALIVE"):
            keep_alive_seconds()


def test_greedy_matches_offline_llm(client, offline_llm):
    from pagefold import SamplingParams

    prompts = random_prompts(3, 5, 40, 512, seed=3)
    sp = SamplingParams(temperature=0, max_tokens=12)
    want = [o.outputs[0] for o in offline_llm.generate(
        [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]
    for p, w in zip(prompts, want):
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0)
        assert r.choices[0].text == w.text
        assert r.usage.completion_tokens == len(w.token_ids)
        assert r.usage.prompt_tokens == len(p)
        assert r.usage.prompt_tokens_details.cached_tokens == 0
    msgs = [{"role": "user", "content": "hello there"}]
    chat_want = offline_llm.chat(msgs, sp, use_tqdm=False)[0].outputs[0]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == chat_want.text
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == len(chat_want.token_ids)


def test_streaming_equals_non_streaming_with_usage(client):
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=10, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True,
                                            stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert last.usage.prompt_tokens_details.cached_tokens == 0
    assert all(c.usage is None for c in chunks[:-1])
    echo = client.completions.create(echo=True, **kw)
    assert echo.choices[0].text == "The quick brown fox" + full.choices[0].text
    chunks = list(client.completions.create(echo=True, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == echo.choices[0].text

    msgs = [{"role": "user", "content": "tell me"}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10,
                                          temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=msgs, max_completion_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.total_tokens == (
        10 + full.usage.prompt_tokens)


def test_logprobs_both_formats(client):
    r = client.completions.create(model=MODEL, prompt="abc def", max_tokens=6, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4 and top[tok] == pytest.approx(val)  # "\ufffd"s collide
        assert val == pytest.approx(max(top.values()))  # greedy takes the best token
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_stop_strings_stream_and_not(client):
    kw = dict(model=MODEL, prompt="stop here", max_tokens=16, temperature=0,
              extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    # a 2-character stop string that first occurs past the start of the text
    i = next(i for i in range(2, len(text) - 1)
             if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2]
             and text.index(text[i:i + 2]) == i)
    stop, want = text[i:i + 2], text[:i]
    r = client.completions.create(stop=[stop, "@@never@@"], **kw)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproducible_and_batch(client):
    kw = dict(model=MODEL, prompt="once upon", max_tokens=6, temperature=1.0,
              extra_body={"ignore_eos": True})
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    assert a == b
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert others - {a}
    batch = client.completions.create(model=MODEL, prompt=["one two", "three"], max_tokens=5,
                                      temperature=0)
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0)
               for p in ("one two", "three")]
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)


def test_64_concurrent_streams(server):
    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                                     timeout=60)

        async def one(i: int):
            stream = await aclient.completions.create(
                model=MODEL, prompt=f"request number {i}", max_tokens=8, temperature=0.8,
                seed=i, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            n_chunks, usage, finish = 0, None, None
            async for c in stream:
                if c.choices:
                    n_chunks += 1
                    finish = c.choices[0].finish_reason or finish
                usage = c.usage or usage
            return n_chunks, usage, finish

        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await aclient.close()

    results = asyncio.run(run())
    assert len(results) == 64
    for n_chunks, usage, finish in results:
        assert usage.completion_tokens == 8 and finish == "length"
        assert 1 <= n_chunks <= 8
    server.wait_pool_whole()


def test_client_disconnect_frees_blocks(server):
    body = {"model": MODEL, "prompt": "a long one", "max_tokens": 240, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", server.url + "/v1/completions",
                                                json=body, headers=HEADERS) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert server.pool()["num_running"] == 1
    server.wait_pool_whole()  # the connection is closed mid-stream

    async def non_streaming():
        async with httpx.AsyncClient(timeout=30) as c:
            task = asyncio.create_task(c.post(server.url + "/v1/completions", headers=HEADERS,
                                              json=dict(body, stream=False)))
            for _ in range(200):
                if (await c.get(server.url + "/v1/admin/pool", headers=HEADERS)).json()[
                        "num_running"]:
                    break
                await asyncio.sleep(0.01)
            assert not task.done()
            task.cancel()  # closes the connection while the server is generating

    asyncio.run(non_streaming())
    pool = server.wait_pool_whole()
    assert pool["num_free_blocks"] == pool["num_usable_blocks"]
    assert server.get("/health").json()["num_in_flight"] == 0


@pytest.mark.parametrize("body,status,param", [
    ("{not json", 400, None),
    ("[1, 2]", 400, None),
    ({"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL, "prompt": 5}, 400, "prompt"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": list(range(5, 5 + MAX_MODEL_LEN + 10))}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": [1, 100000]}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ({"model": MODEL, "prompt": "x", "n": 3, "best_of": 2}, 400, "best_of"),
    ({"model": MODEL, "prompt": "x", "best_of": 2, "stream": True}, 400, "best_of"),
    ({"model": MODEL, "prompt": "x", "response_format": {"type": "yaml"}}, 400,
     "response_format"),
    ({"model": "nope", "prompt": "x"}, 404, "model"),
])
def test_completion_errors(server, body, status, param):
    r = server.post("/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err


def test_chat_errors_auth_and_still_serving(server, client):
    r = server.post("/v1/chat/completions", {"model": MODEL, "messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = server.post("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "x"}], "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = server.post("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "x"}], "max_completion_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = server.post("/v1/completions", {"model": MODEL, "prompt": "x"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    r = server.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = server.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    with pytest.raises(openai.BadRequestError, match="only available on /v1/completions"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       extra_body={"best_of": 2})
    # unknown fields are ignored, and the server still serves
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 3,
                                        "no_such_field": 1, "user": "u1"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    server.wait_pool_whole()


def test_cached_tokens_reported(client):
    prompt = random_prompts(1, 40, 40, 512, seed=11)[0]
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # the two full 16-token blocks of the prompt are reused (prefix caching is on by default)
    assert again.usage.prompt_tokens_details.cached_tokens == 32


def test_core_loop_rejects_aborts_and_answers(offline_llm):
    """The EngineCore process's loop, in-process over inproc sockets: a rejected add comes
    back as a RequestError with the core's message (the server answers it 400)."""
    import msgspec
    import zmq

    from pagefold import SamplingParams
    from pagefold.engine.core_proc import (
        AbortRequests,
        AddRequest,
        OutputMessage,
        Outputs,
        UtilityCall,
        _CoreLoop,
    )

    ctx = zmq.Context()
    socks = [ctx.socket(t) for t in (zmq.PUSH, zmq.PULL, zmq.PUSH, zmq.PULL)]
    try:
        socks[0].bind("inproc://in")
        socks[1].connect("inproc://in")
        socks[2].bind("inproc://out")
        socks[3].connect("inproc://out")
        core = offline_llm.engine
        loop = _CoreLoop(core, socks[1], socks[2], os.getppid())
        enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(OutputMessage)
        sp = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
        for msg in (AddRequest("long", list(range(5, 5 + MAX_MODEL_LEN)), sp),
                    AddRequest("vocab", [5, 10**6], sp), AddRequest("ok", [5, 6, 7], sp),
                    UtilityCall(1, "pool_stats"), UtilityCall(2, "nope")):
            socks[0].send(enc.encode(msg))
        handled, stop, errors, utility = loop.handle_inputs(2000)
        assert handled and not stop
        assert {e.request_id for e in errors} == {"long", "vocab"}
        assert "max_model_len" in errors[0].message and "out of range" in errors[1].message
        assert utility[0].result["num_waiting"] == 1 and "unknown" in utility[1].error
        loop.send(core.step(), errors, utility, with_stats=True)
        out = dec.decode(socks[3].recv())
        assert isinstance(out, Outputs) and out.stats.num_running == 1
        assert [e.request_id for e in out.errors] == ["long", "vocab"]
        socks[0].send(enc.encode(AbortRequests(["ok"])))
        loop.handle_inputs(2000)
        assert not core.has_unfinished()
        core.kv.check_whole()
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()


def test_tokenize_detokenize(server, offline_llm):
    r = server.post("/tokenize", {"prompt": "hello world"})
    ids = offline_llm.tokenizer.encode("hello world")
    assert r.status_code == 200 and r.json()["tokens"] == ids and r.json()["count"] == len(ids)
    r = server.post("/detokenize", {"tokens": ids})
    assert r.json()["prompt"] == "hello world"
    r = server.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.json()["count"] > 2
    assert server.post("/detokenize", {"tokens": [10**6]}).status_code == 400


def test_metrics_count_requests(server):
    text = httpx.get(server.url + "/metrics").text
    values = {}
    for line in text.splitlines():
        if line.startswith("pagefold:") and "{" in line:
            values[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
    assert values["pagefold:prompt_tokens_total"] > 0
    assert values["pagefold:generation_tokens_total"] >= 64 * 8
    assert values["pagefold:time_to_first_token_seconds_count"] >= 64
    assert values["pagefold:e2e_request_latency_seconds_count"] >= 64
    queries = values["pagefold:prefix_cache_queries_total"]
    assert queries >= values["pagefold:prompt_tokens_total"]  # + aborted before a token
    assert 32 <= values["pagefold:prefix_cache_hits_total"] <= queries
    assert values["pagefold:num_requests_running"] == 0


def test_serve_benchmark_runs(server, tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    from benchmarks import serve as bench

    out = tmp_path / "bench.json"
    rc = bench.main([
        "--base-url", server.url + "/v1", "--model", MODEL, "--api-key", KEY,
        "--dataset", "prefix-repetition", "--prefix-len", "20", "--num-prefixes", "2",
        "--num-prompts", "8", "--input-len", "10", "--output-len", "5", "--ignore-eos",
        "--token-ids", "--request-rate", "50", "--max-concurrency", "4",
        "--goodput", "ttft:60000", "tpot:60000", "--result-json", str(out)])
    assert rc == 0
    assert "Output token throughput" in capsys.readouterr().out
    s = json.loads(out.read_text())
    assert s["completed"] == 8 and s["failed"] == 0
    assert s["total_output_tokens"] == 8 * 5 and s["total_input_tokens"] == 8 * 30
    assert s["goodput"] == pytest.approx(s["request_throughput"])
    assert 0 < s["p50_ttft_ms"] <= s["p99_ttft_ms"] and s["mean_itl_ms"] > 0
    assert bench.main(["--model", MODEL, "--goodput", "latency:5"]) == 2  # bad SLO name
    server.wait_pool_whole()


def test_engine_core_death_gives_503(servers):
    srv = servers["doomed"].ready()
    try:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 250, "ignore_eos": True}

        async def run():
            async with httpx.AsyncClient(timeout=30, headers=HEADERS) as c:
                plain = [asyncio.create_task(c.post(srv.url + "/v1/completions", json=body))
                         for _ in range(2)]
                stream_lines: list[str] = []

                async def streaming():
                    async with c.stream("POST", srv.url + "/v1/completions",
                                        json=dict(body, stream=True)) as r:
                        assert r.status_code == 200
                        async for line in r.aiter_lines():
                            stream_lines.append(line)

                streamed = asyncio.create_task(streaming())
                for _ in range(300):
                    pool = (await c.get(srv.url + "/v1/admin/pool")).json()
                    if pool["num_running"] == 3:
                        break
                    await asyncio.sleep(0.01)
                assert pool["num_running"] == 3, pool
                t0 = time.monotonic()
                os.kill(srv.core_pid, signal.SIGKILL)
                results = await asyncio.wait_for(asyncio.gather(*plain), 10)
                await asyncio.wait_for(streamed, 10)
                return results, stream_lines, time.monotonic() - t0

        results, lines, took = asyncio.run(run())
        assert took < 5
        for r in results:
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "engine_unavailable"
        lines = [x for x in lines if x]
        events = [json.loads(x[5:]) for x in lines if x.startswith("data: {")]
        assert "error" in events[-1] and lines[-1] == "data: [DONE]"
        assert events[-1]["error"]["code"] == "engine_unavailable"
        h = httpx.get(srv.url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "dead"
        r = srv.post("/v1/completions", {"model": MODEL, "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    finally:
        srv.stop()
    assert srv.proc.returncode is not None


def test_sigterm_shutdown_leaves_no_process(server):
    server.stop()
    assert server.proc.returncode is not None
    assert not _alive(server.core_pid) and not _alive(server.proc.pid)
