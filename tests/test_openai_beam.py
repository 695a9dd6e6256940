"""Beam search through ``pagefold serve`` (``use_beam_search`` on ``/v1/completions``).

The server's driver (``pagefold/entrypoints/openai/beam.py``: one engine request per live beam
per step) must give the same beams, in the same order, as the offline forking driver
``LLM.beam_search`` on the same tiny float32 model and prompts. Prompts 13 and 15 of
``random_prompts(40, 4, 12, 512, seed=3)`` reach EOS within 12 tokens on the tiny qwen3 (so the
EOS / ``ignore_eos`` paths are exercised; asserted below), prompt 0 does not.
"""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import openai
import pytest
from test_server import KEY, MODEL, Server
from test_server_n import _metrics

from pagefold.testing.tiny_models import random_prompts

PROMPTS = [random_prompts(40, 4, 12, 512, seed=3)[i] for i in (13, 15, 0)]
STEPS = 12
EOS = 2  # <|eos|> of the tiny models


@pytest.fixture(scope="module")
def setup(qwen3_dir, tmp_path_factory):
    from pagefold import LLM

    log = tmp_path_factory.mktemp("server_beam") / "server.log"
    srv = Server.launch(qwen3_dir, log)
    try:
        llm = LLM(str(qwen3_dir), max_model_len=256, kv_cache_memory="8MiB")
        srv.ready()
        yield srv, llm
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server(setup) -> Server:
    return setup[0]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _offline(llm, width: int, ignore_eos: bool, length_penalty: float = 1.0):
    from pagefold import BeamSearchParams

    params = BeamSearchParams(beam_width=width, max_tokens=STEPS, ignore_eos=ignore_eos,
                              length_penalty=length_penalty)
    return llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)


def _expected(llm, width, ignore_eos, length_penalty=1.0):
    """Per prompt, per beam: (generated ids, text without a final EOS, finish reason)."""
    tok = llm.get_tokenizer()
    out = []
    for p, o in zip(PROMPTS, _offline(llm, width, ignore_eos, length_penalty)):
        beams = []
        for s in o.sequences:
            gen = s.tokens[len(p):]
            stop = s.finish_reason == "stop"
            beams.append((gen, tok.decode(gen[:-1] if stop else gen),
                          "stop" if stop else "length"))
        out.append(beams)
    return out


@pytest.mark.parametrize("width,ignore_eos,length_penalty",
                         [(2, False, 1.0), (3, False, 1.0), (2, True, 1.0), (3, True, 1.0),
                          (3, False, 2.0)])  # 2.0 changes these prompts' beams (1.0 vs 2.0)
def test_beams_equal_offline_beam_search(server, client, setup, width, ignore_eos,
                                         length_penalty):
    want = _expected(setup[1], width, ignore_eos, length_penalty)
    if length_penalty != 1.0:  # else a server that ignores length_penalty would pass
        assert want != _expected(setup[1], width, ignore_eos)
    finishes = {f for beams in want for _, _, f in beams}
    # The prompts were chosen so both endings occur (else the EOS paths go untested).
    assert finishes == ({"length"} if ignore_eos else {"stop", "length"})
    r = client.completions.create(
        model=MODEL, prompt=PROMPTS, n=width, max_tokens=STEPS, temperature=0.0,
        extra_body={"use_beam_search": True, "ignore_eos": ignore_eos,
                    "length_penalty": length_penalty, "return_token_ids": True})
    assert [c.index for c in r.choices] == list(range(len(PROMPTS) * width))
    got = [[(c.token_ids, c.text, c.finish_reason)
            for c in r.choices[i * width:(i + 1) * width]] for i in range(len(PROMPTS))]
    assert got == want
    assert r.usage.prompt_tokens == sum(len(p) for p in PROMPTS)
    assert r.usage.completion_tokens == sum(len(g) for beams in want for g, _, _ in beams)
    server.wait_pool_whole()


def test_beam_search_uses_the_prefix_cache(server, client):
    prompt = random_prompts(1, 40, 40, 512, seed=9)[0]  # two full 16-token blocks
    before = server.wait_pool_whole()["prefix_requests_hit"]
    client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=6,
                              extra_body={"use_beam_search": True})
    # Every step after the first re-sends a prompt whose full blocks are cached.
    assert server.wait_pool_whole()["prefix_requests_hit"] - before >= 5 * 3


def test_include_stop_str_in_output_keeps_the_eos_text(server, client, setup):
    want = _expected(setup[1], 2, False)[1]  # prompt 15: both beams end in EOS
    assert all(f == "stop" for _, _, f in want)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], n=2, max_tokens=STEPS,
                                  extra_body={"use_beam_search": True,
                                              "include_stop_str_in_output": True})
    eos_text = setup[1].get_tokenizer().decode([EOS])
    assert [c.text for c in r.choices] == [t + eos_text for _, t, _ in want]


def test_streamed_beams_come_whole(server, client):
    body = dict(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=STEPS,
                extra_body={"use_beam_search": True})
    plain = client.completions.create(**body)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **body))
    choices = [c.choices[0] for c in chunks if c.choices]
    # One chunk per choice: its whole text and its finish reason (beams are known at the end).
    assert [(c.index, c.text, c.finish_reason) for c in choices] == [
        (c.index, c.text, c.finish_reason) for c in plain.choices]
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    server.wait_pool_whole()


@pytest.mark.parametrize("body,param", [
    ({"n": 0}, "n"),
    ({"n": 11}, "n"),  # 2n = 22 logprobs per step > --max-logprobs 20
    ({"logprobs": 1}, "logprobs"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"best_of": 3, "n": 2}, "best_of"),
    ({"guided_choice": ["a"]}, "guided_choice"),
    ({"cache_salt": ""}, "cache_salt"),
])
def test_bad_beam_requests_are_400_naming_the_field(server, body, param):
    r = server.post("/v1/completions", dict({"model": MODEL, "prompt": PROMPTS[0],
                                             "max_tokens": 4, "use_beam_search": True}, **body))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err


def test_chat_beams_equal_offline_beam_search(server, client, setup):
    """Chat with a rendered prompt (vLLM's ``prompt_token_ids``): the message contents are the
    offline beams' texts, best first; streamed, each choice comes whole in one chunk."""
    want = _expected(setup[1], 3, False)[1]
    body = dict(model=MODEL, messages=[], n=3, max_tokens=STEPS,
                extra_body={"use_beam_search": True, "prompt_token_ids": PROMPTS[1]})
    r = client.chat.completions.create(**body)
    assert [(c.index, c.message.content, c.finish_reason) for c in r.choices] == [
        (k, t, f) for k, (_, t, f) in enumerate(want)]
    assert r.usage.completion_tokens == sum(len(g) for g, _, _ in want)
    text = {k: "" for k in range(3)}
    finish = {}
    for ch in client.chat.completions.create(stream=True, **body):
        for c in ch.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [(text[k], finish[k]) for k in range(3)] == [(t, f) for _, t, f in want]
    server.wait_pool_whole()


def test_length_penalty_without_beam_search_is_refused(server):
    # length_penalty only means something with beam search.
    r = server.post("/v1/completions", {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2,
                                        "length_penalty": 0.5})
    assert r.status_code == 400 and "length_penalty" in json.dumps(r.json()["error"]), r.text
    r = server.post("/v1/chat/completions", {"model": MODEL, "messages": [], "max_tokens": 2,
                                             "prompt_token_ids": PROMPTS[0],
                                             "use_beam_search": True, "logprobs": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text


def test_disconnect_mid_beam_search_leaves_the_pool_whole(server):
    """A client that leaves mid-search: the search stops, no step follows, pool whole."""
    steps = 240  # 8 beams x 240 steps: far longer than the few steps seen before leaving
    body = json.dumps({"model": MODEL, "prompt": PROMPTS[2], "n": 8, "max_tokens": steps,
                       "use_beam_search": True, "ignore_eos": True}).encode()
    done = 'pagefold:request_success_total{finished_reason="length"}'
    before = _metrics(server)
    u = urlsplit(server.url)
    with socket.create_connection((u.hostname, u.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 30
        while _metrics(server).get(done, 0) - before.get(done, 0) < 16:  # 2+ steps ran
            assert time.monotonic() < deadline
            time.sleep(0.01)
    server.wait_pool_whole(timeout=10)
    after = _metrics(server)
    # The search stopped early (the steps in flight are aborted, or finish if their outputs
    # were already in when the disconnect was seen) ...
    assert after[done] - before.get(done, 0) < 8 * steps // 2
    time.sleep(0.5)  # ... and no step starts afterwards
    assert {k: v for k, v in _metrics(server).items() if "_total" in k} == {
        k: v for k, v in after.items() if "_total" in k}
