"""Streamed tool calls as OpenAI sends them, and tools for templates that do not render them.

Pure text tests (no model): :class:`ChatStreamView` is fed generated text in small pieces, the
deltas are checked for OpenAI's shape (per call a header with index, id, type, name and
arguments ``""``, then argument pieces) and accumulated the way a client does.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pagefold.entrypoints.openai.serving_chat import ChatStreamView
from pagefold.entrypoints.openai.tool_prompt import template_takes_tools, with_tools_fallback
from pagefold.entrypoints.openai.tool_stream import JsonCallScanner

REQUIRED_OUT = ('[{"name":"get_weather","parameters":{"city":"Paris","unit":"celsius"}},'
                '{"name":"get_time","parameters":{"timezone":"UTC"}}]')
HERMES_OUT = ('I will check.<tool_call>\n{"name": "get_weather", "arguments": '
              '{"city": "Oslo", "unit": "C"}}\n</tool_call>\n<tool_call>\n{"name": "get_time",'
              ' "arguments": {"timezone": "CET"}}\n</tool_call>')


def _view(mode: str, parser: str = "hermes", parallel: bool | None = None,
          name: str | None = None) -> ChatStreamView:
    options = SimpleNamespace(reasoning_parser=None, tool_call_parser=parser)
    req = SimpleNamespace(include_reasoning=True, parallel_tool_calls=parallel)
    return ChatStreamView(options, mode, name, req)


def _run(view: ChatStreamView, text: str, step: int) -> tuple[list[dict], bool]:
    """Feed ``text`` ``step`` characters at a time; all deltas, and whether tools were called."""
    deltas: list[dict] = []
    called = False
    for i in range(0, len(text), step):
        out, called = view.feed(text[i:i + step], i + step >= len(text))
        deltas += out
    return deltas, called


def _accumulate(deltas: list[dict]) -> tuple[str, list[dict]]:
    """(content, calls) rebuilt as a client does, checking OpenAI's delta shapes."""
    content, calls, arg_pieces = "", {}, {}
    for d in deltas:
        assert set(d) <= {"content", "tool_calls", "reasoning_content"}, d
        content += d.get("content") or ""
        for tc in d.get("tool_calls") or ():
            i = tc["index"]
            if i not in calls:
                assert i == len(calls)  # calls open in order
                assert tc["id"] and tc["type"] == "function" and tc["function"]["name"]
                assert tc["function"]["arguments"] == ""  # the header carries no arguments
                calls[i] = {"id": tc["id"], "name": tc["function"]["name"], "arguments": ""}
                arg_pieces[i] = 0
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                calls[i]["arguments"] += tc["function"]["arguments"]
                arg_pieces[i] += 1
    for i, c in calls.items():
        c["pieces"] = arg_pieces[i]
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("step", [1, 3, 7])
def test_required_streams_each_call_as_it_is_generated(step):
    view = _view("required")
    deltas, called = _run(view, REQUIRED_OUT, step)
    content, calls = _accumulate(deltas)
    assert called and content == ""
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert json.loads(calls[1]["arguments"]) == {"timezone": "UTC"}
    # Arguments arrive in pieces while generated (one piece per feed that added to them).
    assert calls[0]["pieces"] >= len('{"city":"Paris","unit":"celsius"}') // step - 1
    # Call 0's header goes out as soon as its name is complete, before its arguments.
    view, fed = _view("required"), 0
    while not view.feed(REQUIRED_OUT[fed:fed + step], False)[0]:
        fed += step
    assert fed + step <= REQUIRED_OUT.index('"parameters"') + step


def test_required_with_parallel_false_sends_one_call():
    deltas, _ = _run(_view("required", parallel=False), REQUIRED_OUT, 2)
    assert [c["name"] for c in _accumulate(deltas)[1]] == ["get_weather"]


@pytest.mark.parametrize("step", [1, 4])
def test_auto_hermes_streams_content_then_calls(step):
    deltas, called = _run(_view("auto"), HERMES_OUT, step)
    content, calls = _accumulate(deltas)
    assert called and content == "I will check."
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo", "unit": "C"}
    assert json.loads(calls[1]["arguments"]) == {"timezone": "CET"}
    assert calls[0]["pieces"] > 2
    # No piece of markup leaks into content or arguments.
    assert "<tool_call" not in json.dumps(deltas) and "</" not in json.dumps(deltas)


def test_auto_json_parser_and_text_without_calls():
    out = '{"name": "get_time", "arguments": {"timezone": "UTC"}}'
    content, calls = _accumulate(_run(_view("auto", parser="json"), out, 2)[0])
    assert content == "" and calls[0]["name"] == "get_time" and calls[0]["pieces"] > 2
    deltas, called = _run(_view("auto"), "Just a plain answer <tool", 3)
    content, calls = _accumulate(deltas)
    assert not called and not calls and content == "Just a plain answer <tool"


def test_auto_pythonic_arrives_whole_at_the_end():
    deltas, called = _run(_view("auto", parser="pythonic"), '[get_time(timezone="UTC")]', 2)
    content, calls = _accumulate(deltas)
    assert called and content == "" and calls[0]["name"] == "get_time"
    assert json.loads(calls[0]["arguments"]) == {"timezone": "UTC"}


def test_arguments_as_a_string_and_missing_arguments():
    out = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    _, calls = _accumulate(_run(_view("auto"), out, 1)[0])
    assert calls[0]["arguments"] == '{"a": 1}'  # the string's JSON, sent once it is complete
    _, calls = _accumulate(_run(_view("auto"), '<tool_call>{"name": "g"}</tool_call>', 1)[0])
    assert calls[0]["name"] == "g" and json.loads(calls[0]["arguments"]) == {}


def test_named_choice_header_first_then_arguments():
    deltas, called = _run(_view("named", name="get_time"), '{"timezone":"UTC"}', 3)
    content, calls = _accumulate(deltas)
    assert not called  # a named choice finishes with "stop", as OpenAI
    assert content == "" and calls[0]["name"] == "get_time" and calls[0]["pieces"] == 6
    assert calls[0]["arguments"] == '{"timezone":"UTC"}'


def test_scanner_ignores_non_calls_and_nesting():
    s = JsonCallScanner()
    s.feed_to('[1, "x", [{"name": "inner"}], {"name": "outer", "parameters": [1, {"a": "}"}]}]')
    assert [c.name for c in s.calls] == ["outer"] and s.done
    assert s.args_text(s.calls[0]) == '[1, {"a": "}"}]'
    s = JsonCallScanner()
    s.feed_to('"a string" {"name": "late"}')
    assert s.calls == [] and s.done
    s = JsonCallScanner()
    s.feed_to('{"parameters": 12, "name": "num"}')  # arguments before the name, a number
    assert s.calls[0].name == "num" and s.args_text(s.calls[0]) == "12"


# ----------------------------------------------------------------------------- fallback
PLAIN = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
         "{% endfor %}")
WITH_TOOLS = "{% if tools %}{{ tools | tojson }}{% endif %}" + PLAIN
TOOL = {"type": "function", "function": {"name": "get_time", "description": "time in a zone",
                                         "parameters": {"type": "object"}}}


def test_template_takes_tools():
    assert not template_takes_tools(PLAIN)
    assert template_takes_tools(WITH_TOOLS)
    assert template_takes_tools({"default": PLAIN, "tool_use": WITH_TOOLS})
    assert not template_takes_tools("{{ messages }} tools are mentioned only in text")


@pytest.mark.parametrize("mode,name,parser,expect", [
    ("named", "get_time", "hermes", "Call the function get_time: reply with its arguments"),
    ("required", None, "hermes", '"parameters"'),
    ("auto", None, "hermes", "<tool_call>"),
    ("auto", None, "pythonic", "Python list"),
    ("auto", None, "json", '{"name"'),
])
def test_fallback_describes_tools_and_how_to_call(mode, name, parser, expect):
    conv = [{"role": "user", "content": "time?"}]
    out = with_tools_fallback(conv, [TOOL], mode, name, parser)
    assert out[0]["role"] == "system" and out[1:] == conv and len(conv) == 1
    text = out[0]["content"]
    assert '"name": "get_time"' in text and "time in a zone" in text
    assert expect in text
    # An existing system prompt keeps its text, tools appended.
    out = with_tools_fallback([{"role": "system", "content": "Be brief."}, *conv], [TOOL],
                              mode, name, parser)
    assert out[0]["content"].startswith("Be brief.\n\n") and "get_time" in out[0]["content"]


def test_fallback_none_and_history():
    conv = [{"role": "user", "content": "time?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_time", "arguments": {"timezone": "UTC"}}}]},
            {"role": "tool", "content": "12:00"}]
    out = with_tools_fallback(conv, [TOOL], "none", None, "hermes")
    assert [m["role"] for m in out] == ["user", "assistant", "tool"]  # none: no tools text
    assert out[1]["content"] == ('<tool_call>{"name": "get_time", "arguments": '
                                 '{"timezone": "UTC"}}</tool_call>')
    assert conv[1]["content"] is None  # the caller's messages are not changed
