"""Structured output and tool calls on the trained model: ``pagefold serve`` on
SmolLM2-135M-Instruct, driven by the official ``openai`` client, every answer checked with
``jsonschema``.

* 20 ``response_format: json_schema`` (strict) requests, each its own schema and prompt, sent
  at once (one batch): every content parses and validates, every finish reason is ``stop``;
* a named-function ``tool_choice`` and ``required``, streamed and not: the arguments parse
  and validate against the tool's schema; streamed, the calls arrive as OpenAI sends them
  (a header delta with id, type, name and arguments ``""``, then argument pieces) and the
  client's own stream accumulation (``chat.completions.stream``) rebuilds them;
* SmolLM2's chat template does not render ``tools``: the tools reach the prompt through the
  system-message fallback (``tool_prompt.py``), which the test reads back via ``/tokenize``.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from pagefold.testing.structured_cases import ASK, CASES, MAX_TOKENS, TOOLS
from tests.test_server import KEY, MODEL, Server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("smollm2_openai") / "server.log"
    srv = Server.launch(smollm2_dir, log, kv_cache_memory="192MiB",  # 20 at once, float32
                        extra_args=("--max-model-len", "1024", "--max-num-seqs", "32",
                                    "--max-num-batched-tokens", "512", "--dtype", "float32",
                                    "--no-warm-up", "--enable-auto-tool-choice",
                                    "--tool-call-parser", "hermes"))
    try:
        yield srv.ready(timeout=180)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def test_20_json_schemas_validate_on_smollm2(client, server):
    def ask(case):
        k, (prompt, schema) = case
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt + " Reply in JSON."}],
            max_tokens=MAX_TOKENS, temperature=0,
            response_format={"type": "json_schema", "json_schema": {
                "name": f"case{k}", "schema": schema, "strict": True}})
        return r.choices[0]

    t0 = time.monotonic()
    with ThreadPoolExecutor(len(CASES)) as pool:
        choices = list(pool.map(ask, enumerate(CASES)))
    secs = time.monotonic() - t0
    print(f"\n20 schemas answered in {secs:.1f} s:")
    for (prompt, _), c in zip(CASES, choices):
        print(f"  {c.finish_reason:6s} {prompt[:40]:40s} {c.message.content}")
    for (prompt, schema), c in zip(CASES, choices):
        assert c.finish_reason == "stop", (prompt, c.message.content)
        value = json.loads(c.message.content)
        jsonschema.validate(value, schema)
        if isinstance(value, dict):  # properties come in the schema's order, as OpenAI's
            order = list(schema.get("properties", {}))
            assert list(value) == [k for k in order if k in value], (prompt, value)
    server.wait_pool_whole()


def _check_call(name: str, arguments: str) -> dict:
    fns = {t["function"]["name"]: t["function"] for t in TOOLS}
    args = json.loads(arguments)
    jsonschema.validate(args, fns[name]["parameters"])
    return args


def _raw_tool_deltas(client, **kw) -> tuple[list, list[str]]:
    """The tool-call deltas of a raw stream, and its finish reasons."""
    deltas, reasons = [], []
    for ch in client.chat.completions.create(model=MODEL, messages=ASK, stream=True,
                                             max_tokens=MAX_TOKENS, temperature=0, **kw):
        for c in ch.choices:
            deltas += c.delta.tool_calls or []
            if c.finish_reason:
                reasons.append(c.finish_reason)
    return deltas, reasons


def _check_openai_shape(deltas) -> None:
    """Per call: first delta index, id, type, name, arguments ""; then argument pieces only."""
    seen: set[int] = set()
    pieces = 0
    for d in deltas:
        if d.index not in seen:
            seen.add(d.index)
            assert d.id and d.type == "function" and d.function.name, d
            assert d.function.arguments == "", d
        else:
            assert d.id is None and d.function.name is None and d.function.arguments, d
            pieces += 1
    assert pieces >= 2 * len(seen), "arguments must stream in pieces, not one lump"


@pytest.mark.parametrize("choice", ["named", "required"])
def test_tool_choice_streamed_and_not_on_smollm2(client, choice):
    tool_choice = ({"type": "function", "function": {"name": "get_weather"}}
                   if choice == "named" else "required")
    kw = dict(tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=MAX_TOKENS,
                                       temperature=0, **kw)
    c = r.choices[0]
    assert c.finish_reason == ("stop" if choice == "named" else "tool_calls"), c
    (call,) = c.message.tool_calls
    if choice == "named":
        assert call.function.name == "get_weather"
    args = _check_call(call.function.name, call.function.arguments)

    # Raw stream: the OpenAI delta shapes.
    deltas, reasons = _raw_tool_deltas(client, **kw)
    _check_openai_shape(deltas)
    assert reasons == [c.finish_reason]
    # The client's own accumulation (strict tools: it also parses the arguments).
    with client.chat.completions.stream(model=MODEL, messages=ASK, max_tokens=MAX_TOKENS,
                                        temperature=0, **kw) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_completion()
    assert events.count("tool_calls.function.arguments.delta") >= 2
    (scall,) = final.choices[0].message.tool_calls
    assert scall.function.name == call.function.name and scall.id
    assert _check_call(scall.function.name, scall.function.arguments) == args  # greedy
    assert scall.function.parsed_arguments == args
    print(f"\n{choice}: {call.function.name}({call.function.arguments}); streamed in "
          f"{len(deltas)} deltas")


def test_tools_reach_smollm2_through_the_fallback(server):
    """SmolLM2's template never reads ``tools``: the system message carries them."""
    base = {"model": MODEL, "messages": ASK}
    plain = server.post("/tokenize", base).json()["count"]
    with_tools = server.post("/tokenize", dict(base, tools=TOOLS)).json()
    assert with_tools["count"] > plain + 40
    r = server.post("/detokenize", {"model": MODEL, "tokens": with_tools["tokens"]})
    text = r.json()["prompt"]
    assert "get_weather" in text and "Get the current time" in text and "<tool_call>" in text
