"""Reading generated chat text: reasoning blocks, tool calls, and the tool-choice grammar.

Reasoning (``--reasoning-parser``): ``<think> ... </think>`` is split off into
``reasoning_content``. ``deepseek_r1``: the template may already have opened the block, so
everything before ``</think>`` is reasoning (all of it while the block is still open);
``qwen3`` / ``think``: only an explicit ``<think> ... </think>`` is reasoning.

Tool calls (``--tool-call-parser``): ``hermes`` reads ``<tool_call>{"name", "arguments"}
</tool_call>`` blocks (Qwen, Hermes); ``pythonic`` reads ``[f(a=1), g(b="x")]``; ``json``
reads a bare ``{"name", "arguments"|"parameters"}`` object or a list of them. Text outside
the calls is the message content. A parse failure leaves the text as content.

``tool_choice`` ``required`` and a named function are enforced with the grammar
(:func:`tool_constraint`): a named choice constrains the output to the function's parameters
schema (the output *is* the arguments); ``required`` to a JSON array of
``{"name", "parameters"}`` objects, one schema per tool.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pagefold.structured_output import StructuredOutputsParams

REASONING_PARSERS = ("deepseek_r1", "qwen3", "think")
TOOL_PARSERS = ("hermes", "pythonic", "json", "qwen", "llama3_json")
THINK_START, THINK_END = "<think>", "</think>"


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def split_reasoning(text: str, parser: str, *, final: bool) -> tuple[str | None, str]:
    """``(reasoning or None, content)`` of (the visible part of) ``text``; while not
    ``final`` a possible partial tag at the end is held back from both."""
    opened = text.lstrip().startswith(THINK_START)
    body = text.lstrip()[len(THINK_START):] if opened else text
    end = body.find(THINK_END)
    if end >= 0:
        return body[:end], body[end + len(THINK_END):].lstrip("\n")
    if opened or parser == "deepseek_r1":  # the block is still open
        if not final:
            body = body[:len(body) - partial_suffix(body, THINK_END)]
        return body, ""
    if not final and text.strip() and THINK_START.startswith(text.strip()):
        return None, ""  # may still become "<think>"
    return None, text


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"

    def to_json(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _call_from_obj(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except json.JSONDecodeError:
            return None
        return ToolCall(obj["name"], args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def tool_start_marker(parser: str) -> str:
    return {"hermes": "<tool_call>", "qwen": "<tool_call>", "pythonic": "["}.get(parser, "{")


def parse_tool_calls(text: str, parser: str) -> tuple[str | None, list[ToolCall]]:
    """``(content or None, calls)`` of a finished output."""
    if parser in ("hermes", "qwen"):
        if "<tool_call>" not in text:
            return text, []
        calls = []
        for m in _HERMES.finditer(text):
            try:
                call = _call_from_obj(json.loads(m.group(1)))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        content = text[:text.index("<tool_call>")].strip()
        return content or None, calls
    if parser == "pythonic":
        return _parse_pythonic(text)
    return _parse_json_calls(text)


def _parse_pythonic(text: str) -> tuple[str | None, list[ToolCall]]:
    s = text.strip()
    if not (s.startswith("[") and s.endswith("]")):
        return text, []
    try:
        tree = ast.parse(s, mode="eval")
    except SyntaxError:
        return text, []
    if not isinstance(tree.body, ast.List):
        return text, []
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name | ast.Attribute):
            return text, []
        name = node.func.id if isinstance(node.func, ast.Name) else ast.unparse(node.func)
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
        except ValueError:
            return text, []
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
    return None, calls


def _parse_json_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    s = text.strip()
    start = min([i for i in (s.find("{"), s.find("[")) if i >= 0], default=-1)
    if start < 0:
        return text, []
    try:
        obj, _ = json.JSONDecoder().raw_decode(s[start:])
    except json.JSONDecodeError:
        return text, []
    objs = obj if isinstance(obj, list) else [obj]
    calls = [_call_from_obj(o) for o in objs]
    if not calls or any(c is None for c in calls):
        return text, []
    return (s[:start].strip() or None), calls  # type: ignore[return-value]


# --------------------------------------------------------------------------- tool_choice
def tool_function(tool: dict) -> dict:
    """The ``function`` object of an OpenAI tool (``{"type": "function", "function": ...}``)."""
    fn = tool.get("function") if tool.get("type", "function") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError("each tool must be {'type': 'function', 'function': {'name': ..., "
                         "'parameters': {...}}}")
    return fn


def _parameters(fn: dict) -> dict:
    params = fn.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def named_choice(tool_choice: Any) -> str | None:
    """The function name of a named ``tool_choice``, else None."""
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return fn["name"]
        raise ValueError("a named tool_choice is {'type': 'function', 'function': {'name': ...}}")
    return None


def tool_constraint(tools: list[dict], tool_choice: Any, parallel: bool = True
                    ) -> StructuredOutputsParams | None:
    """The grammar that enforces ``required`` / a named function (None otherwise);
    ``parallel=False`` (``parallel_tool_calls: false``) allows exactly one call."""
    fns = {tool_function(t)["name"]: tool_function(t) for t in tools}
    name = named_choice(tool_choice)
    if name is not None:
        if name not in fns:
            raise ValueError(f"tool_choice names {name!r}, which is not in tools "
                             f"({', '.join(fns)})")
        return StructuredOutputsParams(json=_parameters(fns[name]))
    if tool_choice == "required":
        items = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [n]},
                                 "parameters": _parameters(fn)},
                  "required": ["name", "parameters"]} for n, fn in fns.items()]
        schema = {"type": "array", "minItems": 1,
                  "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if not parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)
    return None


def parse_required(text: str) -> list[ToolCall]:
    """Calls of a ``required`` output (a JSON array of {name, parameters})."""
    try:
        objs = json.loads(text)
    except json.JSONDecodeError:
        return []
    calls = [_call_from_obj(o) for o in objs] if isinstance(objs, list) else []
    return [c for c in calls if c is not None]


def template_messages(conv: list[dict]) -> list[dict]:
    """Assistant ``tool_calls`` arguments as dicts (templates index into them), as vLLM."""
    for m in conv:
        for call in m.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    pass
    return conv
