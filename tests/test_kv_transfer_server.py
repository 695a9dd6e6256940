"""Prefill/decode disaggregation end to end (issue 38 item 3): two ``pagefold serve``
processes (a kv_producer and a kv_consumer) behind ``pagefold proxy``, driven with the
official ``openai`` client, streaming and not. One test: it starts three processes.

The reference is the decode instance answering the same request directly afterwards: it then
hits its pool at the pulled full blocks (they stayed cached; the prompt's tail pages did not),
so the text must be identical and the logprobs equal up to float rounding (it computes the
tail's tokens in one chunk, the transferred request only the last one); the usage's cached
tokens show the consumer loaded all but the last prompt token instead of computing them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import openai
from test_server import HEADERS, KEY, MODEL, Server, _free_port

from pagefold.entrypoints.openai.fields import refuse_unsupported
from pagefold.entrypoints.openai.protocol import CompletionRequest


def _proxy(prefill: str, decode: str, log) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagefold.entrypoints.cli", "proxy",
                             "--prefill", prefill, "--decode", decode, "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("proxy not up")


def test_proxy_prefill_on_one_instance_decode_on_another(qwen3_dir, tmp_path):
    kv_port = _free_port()
    producer = Server.launch(qwen3_dir, tmp_path / "p.log", extra_args=("--no-warm-up",
        "--kv-transfer-config", json.dumps({
            "kv_connector": "PagefoldConnector", "kv_role": "kv_producer", "kv_port": kv_port,
            "kv_connector_extra_config": {"keep_s": 3}})))
    consumer = Server.launch(qwen3_dir, tmp_path / "c.log", extra_args=("--no-warm-up",
        "--kv-transfer-config", json.dumps({"kv_role": "kv_consumer"})))
    proxy = None
    try:
        producer.ready()
        consumer.ready()
        with open(tmp_path / "proxy.log", "w") as log:
            proxy, url = _proxy(producer.url, consumer.url, log)
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        direct = openai.OpenAI(base_url=consumer.url + "/v1", api_key=KEY, max_retries=0)
        prompt = "one two three four five six seven eight nine ten " * 5
        kw = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
        got = client.completions.create(**kw)
        ref = direct.completions.create(**kw)
        n_prompt = got.usage.prompt_tokens
        cached = got.usage.prompt_tokens_details.cached_tokens
        assert cached == n_prompt - 1 and n_prompt % 16 != 1  # all but the last: pulled
        assert got.choices[0].text == ref.choices[0].text
        for a, b in zip(got.choices[0].logprobs.top_logprobs,
                        ref.choices[0].logprobs.top_logprobs):
            assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a)
        assert ref.usage.prompt_tokens_details.cached_tokens == cached // 16 * 16
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            **kw, stream=True) if c.choices)
        assert streamed == got.choices[0].text
        messages = [{"role": "user", "content": "count: " + prompt}]
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                              temperature=0)
        chat_ref = direct.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                  temperature=0)
        assert chat.choices[0].message.content == chat_ref.choices[0].message.content
        assert chat.usage.prompt_tokens_details.cached_tokens > 0
        chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                temperature=0, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == chat.choices[0].message.content
        c_pool, p_pool = consumer.pool(), producer.pool()
        # The first completion and the first chat pulled their prompts; the repeats hit the
        # consumer's own pool for the full blocks (the pulled pages stayed cached there) and
        # pulled only the tail again (the tokens after the last full block).
        chat_cached = chat.usage.prompt_tokens_details.cached_tokens
        assert chat_cached == chat.usage.prompt_tokens - 1
        assert c_pool["transfer_tokens_loaded"] == (cached + cached % 16 + chat_cached
                                                    + chat_cached % 16)
        assert c_pool["transfer_load_failures"] == 0 and c_pool["whole"]
        assert p_pool["transfer_exports"] == 4 and p_pool["whole"]
        metrics = httpx.get(consumer.url + "/metrics", headers=HEADERS).text
        assert "pagefold:kv_transfer_tokens_loaded_total" in metrics
        # A producer's params sent without a transfer config are a clear 400 (unit check).
        bad = CompletionRequest(model=MODEL, prompt="x", kv_transfer_params={
            "do_remote_prefill": True})
        try:
            refuse_unsupported(bad)
            raise AssertionError("kv_transfer_params accepted without a transfer config")
        except Exception as e:  # noqa: BLE001 - the API error type
            assert "--kv-transfer-config" in str(getattr(e, "message", e))
        # The decode instance dies: the proxy answers 503, the producer frees its export.
        consumer.stop()
        r = httpx.post(url + "/v1/completions", headers=HEADERS, timeout=60,
                       json={"model": MODEL, "prompt": prompt + " again", "max_tokens": 4})
        assert r.status_code == 503
        assert producer.pool()["transfer_exports"] == 5
        deadline = time.monotonic() + 20
        while producer.pool()["transfer_exports_held"] and time.monotonic() < deadline:
            time.sleep(0.2)
        final = producer.pool()
        assert final["transfer_exports_held"] == 0 and final["whole"]
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
        for s in (producer, consumer):
            if s.proc.poll() is None:
                s.stop()
