"""What vLLM users send: structured output, tools, reasoning, generation defaults, vLLM's request
fields, metrics names, launch line. One ``pagefold serve`` process on a tiny random qwen3 model
(a copy whose generation_config.json sets sampling defaults), driven with the ``openai`` client.

A random model constrained by a grammar still has to produce schema-valid JSON: every schema
test validates the output with ``jsonschema``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import httpx
import jsonschema
import openai
import pytest

from tests.test_server import Server, _free_port

MODEL = "tiny"
KEY = "test-key"

# ChatML with Qwen-style tools: the template lists the tools and how to call them.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for t in tools %}"
    "{{ t | tojson }}\n{% endfor %}</tools>\nCall a tool with <tool_call>{\"name\": ..., "
    "\"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}"
    "</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 14}}, "required": ["zone"]}}}


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory, tmp_path_factory):
    """The tiny qwen3 model with sampling defaults in its generation_config.json."""
    src = tiny_model_factory("qwen3")
    d = tmp_path_factory.mktemp("compat") / "model"
    shutil.copytree(src, d)
    gen = json.loads((d / "generation_config.json").read_text())
    gen.update(temperature=0.7, top_k=1, top_p=0.9)  # top_k 1: sampling == greedy
    (d / "generation_config.json").write_text(json.dumps(gen))
    (d.parent / "tools.jinja").write_text(TOOLS_TEMPLATE)
    return d


@pytest.fixture(scope="module")
def server(model_dir):
    srv = Server.launch(model_dir, model_dir.parent / "server.log", kv_cache_memory="16MiB",
                        extra_args=("--chat-template", str(model_dir.parent / "tools.jinja"),
                                    "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                    "--reasoning-parser", "qwen3", "--enable-log-requests",
                                    "--log-stats-interval", "0.5", "--max-num-seqs", "16",
                                    "--max-model-len", "1024"))
    try:
        yield srv.ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def chat(client, content="hello", **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **kw)


# ----------------------------------------------------------------------------- JSON schemas
def _schemas() -> list[dict]:
    s = {"type": "string", "maxLength": 8}
    i = {"type": "integer", "minimum": -50, "maximum": 5000}
    return [
        {"type": "object", "properties": {"name": s, "age": i}, "required": ["name", "age"]},
        {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
        {"type": "array", "items": i, "minItems": 1, "maxItems": 4},
        {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
         "required": ["color"]},
        {"type": "object", "properties": {"p": {"type": "object", "properties": {
            "x": i, "y": i}, "required": ["x", "y"]}}, "required": ["p"]},
        {"type": "string", "maxLength": 12},
        {"type": "integer", "minimum": 0, "maximum": 99},
        {"type": "object", "properties": {"tags": {"type": "array", "items": s,
                                                   "maxItems": 3}}, "required": ["tags"]},
        {"type": "object", "properties": {"v": {"anyOf": [i, {"type": "null"}]}},
         "required": ["v"]},
        {"type": "object", "properties": {"k": {"const": "fixed"}, "n": i},
         "required": ["k", "n"]},
        {"type": "array", "items": {"type": "object", "properties": {"id": i},
                                    "required": ["id"]}, "minItems": 2, "maxItems": 2},
        {"type": "object", "properties": {"a": s, "b": s, "c": s}, "required": ["a", "b", "c"]},
        {"type": "object", "properties": {"date": {"type": "string",
                                                   "pattern": "^[0-9]{4}-[0-9]{2}$"}},
         "required": ["date"]},
        {"type": "boolean"},
        {"type": "object", "properties": {"m": {"type": "object", "properties": {
            "n": {"type": "object", "properties": {"o": i}, "required": ["o"]}},
            "required": ["n"]}}, "required": ["m"]},
        {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 3, "maxItems": 3},
        {"type": "object", "properties": {"score": {"type": "number", "minimum": 0,
                                                    "maximum": 1}}, "required": ["score"]},
        {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}, "count": i},
         "required": ["kind", "count"], "additionalProperties": False},
        {"$defs": {"pt": {"type": "object", "properties": {"x": i}, "required": ["x"]}},
         "type": "object", "properties": {"from": {"$ref": "#/$defs/pt"},
                                          "to": {"$ref": "#/$defs/pt"}},
         "required": ["from", "to"]},
        {"type": "object", "properties": {"email": s, "admin": {"type": "boolean"}},
         "required": ["email", "admin"]},
    ]


def test_json_schema_20_schemas_validate(client):
    for k, schema in enumerate(_schemas()):
        r = chat(client, f"give me json number {k}", max_tokens=200, seed=k, temperature=1.0,
                 response_format={"type": "json_schema", "json_schema": {
                     "name": f"s{k}", "schema": schema, "strict": True}})
        c = r.choices[0]
        assert c.finish_reason == "stop", (k, c.message.content)
        jsonschema.validate(json.loads(c.message.content), schema)


def test_json_object_stream_n_and_completions(client, server):
    # n > 1 and streaming: every choice is a JSON object.
    stream = chat(client, "json please", max_tokens=200, n=3, temperature=1.0, seed=3,
                  stream=True, response_format={"type": "json_object"})
    texts = ["", "", ""]
    for ch in stream:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    for t in texts:
        assert isinstance(json.loads(t), dict), t
    # The completions endpoint, vLLM's structured_outputs and the older guided_* fields.
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=20, temperature=1.0,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=20, temperature=1.0,
                                  extra_body={"guided_regex": "[a-c]{3}-[0-9]{2}"})
    import re
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", r.choices[0].text)
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=20,
                                  extra_body={"guided_grammar": 'root ::= "A" ("B" | "C")'})
    assert r.choices[0].text in ("AB", "AC")
    r = chat(client, max_tokens=60, extra_body={"guided_json": {
        "type": "object", "properties": {"q": {"type": "integer", "minimum": 1,
                                               "maximum": 9}}, "required": ["q"]}})
    assert 1 <= json.loads(r.choices[0].message.content)["q"] <= 9
    server.wait_pool_whole()


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}, "response_format"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"guided_decoding_backend": "nonsense", "guided_regex": "a"}, "guided_decoding_backend"),
])
def test_bad_constraints_are_400_saying_why(server, body, param):
    r = server.post("/v1/chat/completions", dict(
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, **body))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] in (param, "structured_outputs"), err
    assert err["message"]
    server.wait_pool_whole()


def test_compile_errors_name_the_reason(server):
    r = server.post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "x"}],
        "structured_outputs": {"grammar": "root ::= undefined_rule"}})
    assert r.status_code == 400 and "undefined_rule" in r.json()["error"]["message"]


# ----------------------------------------------------------------------------- tools
def _validate_call(call, tools):
    fns = {t["function"]["name"]: t["function"] for t in tools}
    assert call.type == "function" and call.id
    jsonschema.validate(json.loads(call.function.arguments),
                        fns[call.function.name]["parameters"])


def test_named_tool_choice_stream_and_not(client):
    tools = [WEATHER, TIME]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(client, "weather?", tools=tools, tool_choice=choice, max_tokens=60)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    _validate_call(calls[0], tools)
    # Streamed: first delta has id, type and name; the arguments arrive in pieces.
    args, names, ids, pieces = "", [], [], 0
    for ch in chat(client, "weather?", tools=tools, tool_choice=choice, max_tokens=60,
                   stream=True):
        for c in ch.choices:
            for tc in c.delta.tool_calls or ():
                assert tc.index == 0
                if tc.id:
                    ids.append(tc.id)
                    names.append(tc.function.name)
                args += tc.function.arguments or ""
                pieces += 1
    # At least the header and one arguments delta: more depends on timing, since outputs that
    # pile up while the client is busy are coalesced (engine/client.py), as in vLLM.
    assert names == ["get_weather"] and len(ids) == 1 and pieces >= 2
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
    assert json.loads(args) == json.loads(calls[0].function.arguments)  # top_k 1: greedy


def test_required_tool_choice(client):
    """required: the grammar makes the output a list of calls (exactly one with
    parallel_tool_calls false, so a random model cannot run past max_tokens)."""
    tools = [WEATHER, TIME]
    for stream in (False, True):
        if not stream:
            r = chat(client, "call something", tools=tools, tool_choice="required",
                     max_tokens=150, temperature=1.0, seed=5, parallel_tool_calls=False)
            calls = r.choices[0].message.tool_calls
            assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
        else:
            got, pieces = {}, 0
            for ch in chat(client, "call something", tools=tools, tool_choice="required",
                           max_tokens=150, temperature=1.0, seed=5, stream=True,
                           parallel_tool_calls=False):
                for c in ch.choices:
                    for tc in c.delta.tool_calls or ():
                        if tc.index not in got:  # the header: id, type, name, no arguments
                            assert tc.id and tc.function.name
                            assert tc.function.arguments == ""
                            got[tc.index] = tc
                        else:  # argument pieces while they are generated
                            got[tc.index].function.arguments += tc.function.arguments
                            pieces += 1
                    if c.finish_reason:
                        assert c.finish_reason == "tool_calls"
            calls = [got[i] for i in sorted(got)]
            # Arguments came after the header (how many pieces depends on which tool the
            # sampled call picked; the named test checks several pieces for one that always
            # spans several tokens).
            assert pieces >= 1
        assert len(calls) == 1
        for call in calls:
            _validate_call(call, tools)


HERMES_OUT = ('I will check.<tool_call>\n{"name": "get_weather", "arguments": '
              '{"city": "Oslo", "unit": "C"}}\n</tool_call>')


def test_auto_tool_choice_hermes_parser(client):
    """auto: the model's text is parsed by --tool-call-parser hermes (the output is forced
    with a choice constraint: a random model never writes a call on its own)."""
    kw = dict(tools=[WEATHER], tool_choice="auto", max_tokens=300,
              extra_body={"structured_outputs": {"choice": [HERMES_OUT]}})
    r = chat(client, "weather in Oslo?", **kw)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert m.content == "I will check."
    assert [c.function.name for c in m.tool_calls] == ["get_weather"]
    assert json.loads(m.tool_calls[0].function.arguments) == {"city": "Oslo", "unit": "C"}
    content, calls, reasons = "", {}, []
    for ch in chat(client, "weather in Oslo?", stream=True, **kw):
        for c in ch.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or ():
                if tc.index not in calls:
                    assert tc.function.name == "get_weather" and tc.function.arguments == ""
                    calls[tc.index] = ""
                calls[tc.index] += tc.function.arguments
            reasons += [c.finish_reason] if c.finish_reason else []
    assert content == "I will check." and list(calls) == [0] and reasons == ["tool_calls"]
    assert json.loads(calls[0]) == {"city": "Oslo", "unit": "C"}
    # No call in the text: plain content, finish "stop"-like.
    r = chat(client, "hi", tools=[WEATHER], max_tokens=10,
             extra_body={"structured_outputs": {"choice": ["just text"]}})
    assert r.choices[0].message.content == "just text" and not r.choices[0].message.tool_calls


def test_tools_reach_the_template(server):
    r = server.post("/tokenize", {"model": MODEL, "messages": [
        {"role": "user", "content": "x"}], "tools": [WEATHER]})
    with_tools = r.json()["count"]
    r = server.post("/tokenize", {"model": MODEL, "messages": [
        {"role": "user", "content": "x"}]})
    assert with_tools > r.json()["count"] + 20
    assert r.json()["token_strs"] is None


def test_tool_call_history_renders(client):
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{
                "id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Lima", "unit": "C"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "20 C"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER],
                                       max_tokens=4, tool_choice="none")
    assert r.choices[0].message.tool_calls in (None, [])


def test_reasoning_parser_splits_think(client):
    kw = dict(max_tokens=60, extra_body={"structured_outputs": {
        "choice": ["<think>\nsome thought\n</think>\n\nthe answer"]}})
    m = chat(client, "q", **kw).choices[0].message
    assert m.reasoning_content == "\nsome thought\n" and m.content == "the answer"
    reasoning, content = "", ""
    for ch in chat(client, "q", stream=True, **kw):
        for c in ch.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    assert (reasoning, content) == ("\nsome thought\n", "the answer")


# ----------------------------------------------------------------------------- defaults
def test_generation_config_defaults_apply(client, server, model_dir):
    """No sampling fields: the checkpoint's top_k=1 makes unseeded sampling greedy."""
    outs = {client.completions.create(model=MODEL, prompt="The", max_tokens=12).choices[0].text
            for _ in range(3)}
    assert len(outs) == 1
    greedy = client.completions.create(model=MODEL, prompt="The", max_tokens=12,
                                       temperature=0).choices[0].text
    assert outs == {greedy}
    # An explicit field wins over the default: top_k=0 at temperature 1 samples.
    sampled = {client.completions.create(model=MODEL, prompt="The", max_tokens=12,
                                         temperature=1.0, seed=s,
                                         extra_body={"top_k": 0}).choices[0].text
               for s in range(4)}
    assert len(sampled) > 1
    log = server.log.read_text()
    assert "generation config" in log and "'top_k': 1" in log


def test_offline_generation_defaults(model_dir):
    from pagefold import LLM

    llm = LLM(str(model_dir), max_model_len=128, kv_cache_memory="4MiB")
    assert llm.get_default_sampling_params().top_k == 1
    llm2 = LLM(str(model_dir), max_model_len=128, kv_cache_memory="4MiB",
               generation_config="vllm")
    assert llm2.get_default_sampling_params().top_k == 0


# ----------------------------------------------------------------------------- logprobs etc.
def test_echo_logprobs_scores_the_prompt(client, model_dir):
    """lm-eval's log-likelihood request: echo + logprobs returns prompt token logprobs,
    equal to the HF model's."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = list(range(20, 40))
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True,
                                  logprobs=2, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 21 and lp.token_logprobs[0] is None
    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(m(torch.tensor([prompt])).logits[0].float(), -1)
    for p in range(1, 20):
        assert abs(lp.token_logprobs[p] - ref[p - 1, prompt[p]].item()) < 1e-3
    # prompt_logprobs on its own (vLLM's extra field); -1 is refused.
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                  extra_body={"prompt_logprobs": 1})
    pl = r.choices[0].prompt_logprobs
    assert pl[0] is None and len(pl) == 20 and str(prompt[1]) in pl[1]
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                  extra_body={"prompt_logprobs": -1})


def test_token_controls(client, server):
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=6, temperature=1.0,
                                  seed=1, extra_body={"allowed_token_ids": [40, 41],
                                                      "return_token_ids": True})
    assert set(r.choices[0].token_ids) <= {40, 41}
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=5, temperature=0,
                                  logit_bias={"77": 100}, extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == [77] * 5
    # bad_words: the greedy first token, as a word, is never generated.
    base = client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0,
                                     extra_body={"return_token_ids": True}).choices[0]
    first = base.token_ids[0]
    word = server.post("/detokenize", {"model": MODEL, "tokens": [first]}).json()["prompt"]
    ids = server.post("/tokenize", {"model": MODEL, "prompt": word,
                                    "add_special_tokens": False}).json()["tokens"]
    if ids == [first] and word.strip():
        r = client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0,
                                      extra_body={"bad_words": [word],
                                                  "return_token_ids": True})
        assert first not in r.choices[0].token_ids
    r = client.completions.create(model=MODEL, prompt=list(range(10, 60)), max_tokens=1,
                                  extra_body={"truncate_prompt_tokens": 7})
    assert r.usage.prompt_tokens == 7


def test_misc_vllm_behaviours(server, client):
    # model "" falls back to the served model; stream_options without stream is 400.
    r = server.post("/v1/completions", {"model": "", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200, r.text
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2,
                                        "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    # continuous usage stats: every chunk has usage.
    chunks = list(client.completions.create(
        model=MODEL, prompt="x", max_tokens=4, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks)
    assert [c.usage.completion_tokens for c in chunks if c.choices][-1] == 4
    # chat echo: the final assistant message is echoed.
    r = client.chat.completions.create(
        model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "a"},
                                             {"role": "assistant", "content": "Hello"}],
        extra_body={"echo": True, "continue_final_message": True,
                    "add_generation_prompt": False})
    assert r.choices[0].message.content.startswith("Hello")
    r = server.post("/tokenize", {"model": MODEL, "prompt": "hello world",
                                  "return_token_strs": True})
    assert len(r.json()["token_strs"]) == r.json()["count"]
    spec = server.get("/openapi.json").json()  # behind the API key (issue 16)
    assert "/v1/chat/completions" in spec["paths"] and "/v1/completions" in spec["paths"]


def test_vllm_metric_names_and_logs(server, client):
    client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    text = server.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:request_success_total",
                 "vllm:prefix_cache_queries_total", "vllm:e2e_request_latency_seconds_count"):
        assert f'{name}{{' in text or f"{name} " in text, name
    assert 'vllm:prompt_tokens_total{model_name="tiny"}' in text
    import time
    time.sleep(1.2)
    log = server.log.read_text()
    assert "Avg prompt throughput" in log and "Prefix cache hit rate" in log
    assert "Received request" in log


# ----------------------------------------------------------------------------- field walk
# Every field of vLLM's ChatCompletionRequest / CompletionRequest (vLLM 0.11-0.12 protocol),
# with a value that is not its default. Each must be honoured (200) or refused by name (400).
COMMON_FIELDS = {
    "frequency_penalty": 0.5, "logit_bias": {"5": 1.0}, "n": 2, "presence_penalty": 0.5,
    "seed": 7, "stop": ["zz"], "stream": True, "stream_options": {"include_usage": True},
    "temperature": 0.5, "top_p": 0.9, "user": "u", "use_beam_search": True, "top_k": 5,
    "min_p": 0.1, "repetition_penalty": 1.1, "watermarking": True, "length_penalty": 0.5,
    "stop_token_ids": [9], "include_stop_str_in_output": True, "ignore_eos": True,
    "min_tokens": 1, "skip_special_tokens": False, "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 3, "truncation_side": "right", "prompt_logprobs": 1,
    "logprob_token_ids": [1], "allowed_token_ids": [10, 11], "bad_words": ["ab"],
    "add_special_tokens": True, "response_format": {"type": "json_object"},
    "structured_outputs": {"choice": ["a", "b"]}, "priority": 1, "request_id": "abc",
    "session_id": "s", "return_tokens_as_token_ids": True, "return_token_ids": True,
    "routed_experts_prompt_start": 1, "return_token_offsets": True, "mm_payload": "none",
    "return_mm_kwargs": True, "cache_salt": "salt", "kv_transfer_params": {"a": 1},
    "ec_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1}, "repetition_detection": {"a": 1},
    "stream_interval": 4, "thinking_token_budget": 5, "max_tokens": 3,
    "prompt_logprobs_temperature": 0.5,
    # older vLLM names
    "guided_json": {"type": "object"}, "guided_regex": "[ab]", "guided_choice": ["a"],
    "guided_grammar": 'root ::= "a"', "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ", "logits_processors": ["x"],
}
CHAT_FIELDS = {
    **COMMON_FIELDS, "logprobs": True, "top_logprobs": 2, "max_completion_tokens": 3,
    "tools": [WEATHER], "tool_choice": "none", "reasoning_effort": "low",
    "include_reasoning": False, "parallel_tool_calls": False, "echo": True,
    "add_generation_prompt": False, "continue_final_message": True,
    "documents": [{"title": "t", "text": "x"}], "chat_template": TOOLS_TEMPLATE,
    "chat_template_kwargs": {"enable_thinking": False}, "media_io_kwargs": {"a": {}},
    "mm_processor_kwargs": {"a": 1}, "return_prompt_text": True, "prompt_token_ids": [5, 6],
}
COMPLETION_FIELDS = {
    **COMMON_FIELDS, "echo": True, "logprobs": 2, "suffix": "s", "best_of": 2,
    "prompt_embeds": "AAAA",
}
ALWAYS_REFUSED = {"watermarking", "length_penalty",
                  "spaces_between_special_tokens",
                  "routed_experts_prompt_start", "return_token_offsets", "mm_payload",
                  "return_mm_kwargs", "kv_transfer_params", "ec_transfer_params",
                  "vllm_xargs", "repetition_detection", "stream_interval",
                  "thinking_token_budget", "media_io_kwargs", "mm_processor_kwargs",
                  "return_prompt_text", "suffix", "prompt_embeds", "logits_processors",
                  "guided_whitespace_pattern"}


def _declared(model) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_vllm_field_is_honoured_or_refused_by_name(server, endpoint):
    from pagefold.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    fields = CHAT_FIELDS if endpoint == "chat" else COMPLETION_FIELDS
    model = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
    assert set(fields) - _declared(model) == set()  # none falls into "extra: ignore"
    if endpoint == "chat":
        base = {"model": MODEL, "messages": [{"role": "user", "content": "x"},
                                             {"role": "assistant", "content": "y"}],
                "max_tokens": 3}
        path = "/v1/chat/completions"
    else:
        base = {"model": MODEL, "prompt": "hello there", "max_tokens": 3}
        path = "/v1/completions"
    for name, value in fields.items():
        body = dict(base, **{name: value})
        if name == "stream_options":
            body["stream"] = True
        if name == "continue_final_message":
            body["add_generation_prompt"] = False
        if name == "top_logprobs":
            body["logprobs"] = True
        r = server.post(path, body)
        if name in ALWAYS_REFUSED:
            assert r.status_code == 400, (name, r.text)
        if r.status_code == 400:
            err = r.json()["error"]
            assert name in (err["param"] or "") or name in err["message"], (name, err)
        else:
            assert r.status_code == 200, (name, r.status_code, r.text)
    server.wait_pool_whole()


# ----------------------------------------------------------------------------- launch line
@pytest.mark.slow
def test_vllm_launch_line_starts(model_dir, tmp_path):
    """``vllm serve MODEL --enable-prefix-caching --gpu-memory-utilization 0.9
    --max-model-len 4096 --disable-log-requests --generation-config auto --max-num-seqs 64``
    with ``pagefold serve`` in place of ``vllm serve`` (plus a free port)."""
    port = _free_port()
    line = (f"{sys.executable} -m pagefold.entrypoints.cli serve {model_dir} "
            "--enable-prefix-caching --gpu-memory-utilization 0.9 --max-model-len 4096 "
            "--disable-log-requests --generation-config auto --max-num-seqs 64 "
            "--enforce-eager --trust-remote-code").split() + ["--port", str(port)]
    log = tmp_path / "launch.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(line, stdout=f, stderr=subprocess.STDOUT)
    srv = Server(proc, f"http://127.0.0.1:{port}", log)
    try:
        srv.ready()
        r = httpx.post(srv.url + "/v1/completions", json={
            "model": str(model_dir), "prompt": "hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200, r.text
        info = httpx.get(srv.url + "/v1/models").json()["data"][0]
        assert info["max_model_len"] == 4096
    finally:
        srv.stop()
    text = log.read_text()
    assert "--enforce-eager accepted and ignored" in text
    assert "gpu_memory_utilization 0.9" in text


def test_vllm_behaviours_on_chat(server, client):
    """The same vLLM behaviours on /v1/chat/completions: model "" is the served model,
    stream_options needs stream, every streamed chunk carries usage with
    continuous_usage_stats, guided_choice constrains, prompt_logprobs -1 is refused by name."""
    msgs = [{"role": "user", "content": "hi"}]
    r = server.post("/v1/chat/completions", {"model": "", "messages": msgs, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == MODEL, r.text
    r = server.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 2,
                                             "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=4, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None and c.usage.prompt_tokens > 0 for c in chunks)
    assert [c.usage.completion_tokens for c in chunks if c.choices][-1] == 4
    # guided_choice (the older vLLM name) is honoured, not ignored.
    for seed in range(3):
        r = chat(client, max_tokens=10, temperature=1.0, seed=seed,
                 extra_body={"guided_choice": ["alpha", "beta"]})
        assert r.choices[0].message.content in ("alpha", "beta")
    for body, name in (({"prompt_logprobs": -1}, "prompt_logprobs"),):
        r = server.post("/v1/chat/completions", dict(
            {"model": MODEL, "messages": msgs, "max_tokens": 2}, **body))
        assert r.status_code == 400 and name in json.dumps(r.json()["error"]), r.text
    server.wait_pool_whole()
