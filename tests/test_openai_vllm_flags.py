"""What vLLM's own OpenAI-server tests ask of a server (found running them against
``pagefold serve``): their launch flags, ``GET /load``, ``/tokenizer_info``, forced usage,
``return_token_ids`` while streaming, ``return_tokens_as_token_ids``, token-in chat, the
``stop_token_ids`` range check and the rest of vLLM's metric families.

One ``pagefold serve`` on a tiny random qwen3 model, started with vLLM's flags, driven with the
official ``openai`` client.
"""

from __future__ import annotations

import threading
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_server import KEY, MODEL, Server

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm_flags")
    (d / "chatml.jinja").write_text(CHATML)
    srv = Server.launch(tiny_model_factory("qwen3"), d / "server.log", kv_cache_memory="16MiB",
                        extra_args=(
                            "--chat-template", str(d / "chatml.jinja"),
                            "--enable-force-include-usage", "--enable-tokenizer-info-endpoint",
                            "--return-tokens-as-token-ids", "--enable-server-load-tracking",
                            "--enable-chunked-prefill", "--enable-prompt-tokens-details",
                            "--skip-tokenizer-init", "--show-hidden-metrics-for-version=0.1",
                            "--max-num-seqs", "8",
                            # One decode token per step (the step metrics' test counts them).
                            "--decode-burst-ms", "0"))
    try:
        yield srv.ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_load_counts_generation_requests(server):
    assert server.get("/load").json() == {"server_load": 0}
    done = threading.Event()

    def long_request():
        server.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 200,
                                        "ignore_eos": True, "temperature": 0})
        done.set()

    threading.Thread(target=long_request, daemon=True).start()
    seen = 0
    while not done.is_set() and not seen:
        seen = server.get("/load").json()["server_load"]
        time.sleep(0.01)
    assert seen == 1
    done.wait(60)
    time.sleep(0.1)
    assert server.get("/load").json() == {"server_load": 0}


def test_tokenizer_info(server):
    r = server.get("/tokenizer_info")
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["tokenizer_class"] and isinstance(info["tokenizer_class"], str)
    assert all(not k.endswith("_file") for k in info)
    assert all(isinstance(info[k], str) for k in ("eos_token", "pad_token") if info.get(k))
    added = info["added_tokens_decoder"]
    assert added and all(isinstance(t["content"], str) and isinstance(t["special"], bool)
                         for t in added.values())


def test_force_include_usage_every_chunk(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    assert [c.usage.completion_tokens for c in chunks if c.choices][-1] == 6
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
               for c in chunks)


def test_return_token_ids_completions(client):
    kw = dict(model=MODEL, prompt="the cat", max_tokens=8, temperature=0, logprobs=1,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    full = client.completions.create(**kw).choices[0]
    assert len(full.token_ids) == 8 and full.prompt_token_ids
    # the server names logprob tokens by id (--return-tokens-as-token-ids)
    assert full.logprobs.tokens == [f"token_id:{t}" for t in full.token_ids]
    chunks = list(client.completions.create(stream=True, **kw))
    assert chunks[-1].choices == []  # the forced usage chunk
    chunks = chunks[:-1]
    ids, lp_ids = [], []
    for c in chunks:
        ids += c.choices[0].token_ids
        lp_ids += [int(t.removeprefix("token_id:")) for t in c.choices[0].logprobs.tokens]
    assert ids == lp_ids == full.token_ids
    assert chunks[0].choices[0].prompt_token_ids == full.prompt_token_ids
    assert all(getattr(c.choices[0], "prompt_token_ids", None) is None for c in chunks[1:])
    plain = client.completions.create(model=MODEL, prompt="the cat", max_tokens=2,
                                      logprobs=1, extra_body={
                                          "return_tokens_as_token_ids": False}).choices[0]
    assert not any(t.startswith("token_id:") for t in plain.logprobs.tokens)
    assert plain.model_dump()["token_ids"] is None
    assert "prompt_token_ids" in plain.model_dump()  # vLLM's keys, null when not asked


def test_return_token_ids_chat_stream(client, server):
    msgs = [{"role": "user", "content": "hello there"}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    full = client.chat.completions.create(**kw)
    rendered = server.post("/tokenize", {"messages": msgs}).json()["tokens"]
    assert full.prompt_token_ids == rendered and len(full.choices[0].token_ids) == 8
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].prompt_token_ids == rendered
    assert all("prompt_token_ids" not in c.model_dump() for c in chunks[1:])
    ids = [t for c in chunks if c.choices for t in c.choices[0].token_ids]
    assert ids == full.choices[0].token_ids


def test_chat_token_in(client, server):
    msgs = [{"role": "user", "content": "hello there"}]
    ids = server.post("/tokenize", {"messages": msgs}).json()["tokens"]
    base = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6,
                                          temperature=0)
    tin = client.chat.completions.create(model=MODEL, messages=[], max_tokens=6,
                                         temperature=0, extra_body={
                                             "prompt_token_ids": ids,
                                             "return_token_ids": True})
    assert tin.prompt_token_ids == ids
    assert tin.choices[0].message.content == base.choices[0].message.content
    for extra, param in (({"add_generation_prompt": True}, "add_generation_prompt"),
                         ({"messages": msgs}, "prompt_token_ids")):
        body = {"model": MODEL, "messages": [], "max_tokens": 2, "prompt_token_ids": ids,
                **extra}
        r = server.post("/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_stop_token_ids_out_of_vocab(server):
    vocab = server.post("/detokenize", {"tokens": [10**9]}).json()["error"]["message"]
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                        "stop_token_ids": [10**6]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "stop_token_ids" and "1000000" in err["message"]
    assert vocab.split("[0, ")[1].split(")")[0] in err["message"]  # the vocabulary size


def _samples(server) -> dict[str, float]:
    text = server.get("/metrics").text
    return {s.name: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name.startswith("vllm:")}


def test_vllm_metric_families(client, server):
    before = _samples(server)
    prompt = [5, 6, 7, 8, 9, 10]
    for _ in range(3):  # one at a time: every step holds one request (and one token)
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = _samples(server)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    # vLLM's definition: a step counts its generated tokens plus the prompts it finished.
    assert delta("vllm:iteration_tokens_total_sum") == 3 * (len(prompt) + 4)
    assert delta("vllm:iteration_tokens_total_count") == 3 * 4
    assert delta("vllm:request_params_n_count") == 3
    assert delta("vllm:request_params_max_tokens_sum") == 3 * 4
    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(f"vllm:request_{phase}_time_seconds_count") == 3, phase
    assert after["vllm:request_inference_time_seconds_sum"] >= (
        after["vllm:request_decode_time_seconds_sum"]) > 0
    assert any(k.startswith("vllm:cache_config_info") for k in after)
    assert "vllm:gpu_prefix_cache_queries_total" in after


def test_prompt_logprobs_temperature(client, server):
    seed = [5, 6, 7, 8, 9]
    top = client.completions.create(model=MODEL, prompt=seed, max_tokens=1, temperature=0,
                                    extra_body={"return_token_ids": True})
    prompt = seed + top.choices[0].token_ids  # its last token is the argmax there

    def last(**extra) -> dict:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                      extra_body={"prompt_logprobs": 0, **extra})
        return r.choices[0].prompt_logprobs[-1][str(prompt[-1])]

    low, one, high = (last(prompt_logprobs_temperature=t) for t in (0.1, 1.0, 5.0))
    assert low["logprob"] > one["logprob"] > high["logprob"]
    assert one == last()  # 1 is the raw distribution
    r = server.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                        "prompt_logprobs": 0,
                                        "prompt_logprobs_temperature": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == (
        "prompt_logprobs_temperature"), r.text


def test_tokenize_special_tokens_defaults():
    """vLLM's defaults: a prompt gets the tokenizer's special tokens (BOS), messages do not
    (the chat template writes them), so /tokenize of messages gives chat completion's ids."""
    from pagefold.entrypoints.openai.protocol import TokenizeRequest

    msgs = [{"role": "user", "content": "x"}]
    assert TokenizeRequest(prompt="x").special_tokens() is True
    assert TokenizeRequest(messages=msgs).special_tokens() is False
    assert TokenizeRequest(messages=msgs, add_special_tokens=True).special_tokens() is True
    assert TokenizeRequest(prompt="x", add_special_tokens=False).special_tokens() is False


def test_logprob_token_ids(client, server):
    """The logprobs of the asked ids (plus the sampled token) instead of the top-k, equal to
    their logprobs in a full top-k listing."""
    asked, forced = [30, 7, 19], 42
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
              temperature=0, logprobs=True)
    r = client.chat.completions.create(top_logprobs=2, extra_body={
        "logprob_token_ids": asked, "allowed_token_ids": [forced]}, **kw)
    pos = r.choices[0].logprobs.content[0]
    assert pos.token == f"token_id:{forced}"
    got = {int(e.token.removeprefix("token_id:")): e.logprob for e in pos.top_logprobs}
    assert set(got) == {*asked, forced}
    full = client.chat.completions.create(top_logprobs=20, extra_body={
        "allowed_token_ids": [forced]}, **kw).choices[0].logprobs.content[0].top_logprobs
    ref = {int(e.token.removeprefix("token_id:")): e.logprob for e in full}
    for t in set(got) & set(ref):
        assert abs(got[t] - ref[t]) < 1e-4, t
    stream = client.chat.completions.create(stream=True, extra_body={
        "logprob_token_ids": [5], "allowed_token_ids": [forced]}, **kw)
    seen = {e.token for c in stream if c.choices and c.choices[0].logprobs
            for p in c.choices[0].logprobs.content for e in p.top_logprobs}
    assert seen == {"token_id:5", f"token_id:{forced}"}
    comp = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, logprobs=0,
                                     extra_body={"logprob_token_ids": [5, 6]})
    assert all({f"token_id:{t}" for t in (5, 6)} <= set(top)
               for top in comp.choices[0].logprobs.top_logprobs)
    for body, param in (({"logprob_token_ids": [5]}, "logprob_token_ids"),  # no logprobs
                        ({"logprob_token_ids": [10**7], "logprobs": 1}, "logprob_token_ids")):
        r = server.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1,
                                            **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
