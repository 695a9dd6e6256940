"""Tools for chat templates that do not render them (SmolLM2's, many older ones).

vLLM hands ``tools`` to the chat template and nothing else: with a template that never reads
``tools`` the model is asked to call functions it was never shown. Here, when the template
does not reference ``tools`` (:func:`template_takes_tools`), :func:`with_tools_fallback`
describes them in the system message -- each function's name, description and parameters
schema, one JSON line each -- followed by how to call, which depends on ``tool_choice``:

* a named function: "reply with the arguments of NAME as one JSON object" (the grammar then
  forces exactly that);
* ``required``: "reply with a JSON array of {"name", "parameters"} objects" (grammar-forced);
* ``auto``: the ``--tool-call-parser``'s own format (``<tool_call>{"name", "arguments"}
  </tool_call>`` for hermes / qwen, ``[f(a=1)]`` for pythonic, a bare JSON object for json);
* ``none``: nothing is added (the model may not call).

An existing system message keeps its text, with the tools appended; otherwise a system
message is put first. Earlier assistant ``tool_calls`` that such a template would drop are
written into the message's content as ``<tool_call>`` JSON, so the model sees its history.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=32)
def _references_tools(source: str) -> bool:
    try:
        import jinja2
        from jinja2 import meta

        names = meta.find_undeclared_variables(jinja2.Environment().parse(source))
    except Exception:  # noqa: BLE001 - an unparsable template fails later, with its own 400
        return "tools" in source
    return "tools" in names


def template_takes_tools(template: Any) -> bool:
    """Whether a chat template (text, or Hugging Face's dict of named templates) renders
    ``tools``; True when unknown (a template that is not text is trusted)."""
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    if not isinstance(template, str):
        return True
    return _references_tools(template)


def _function_line(tool: dict) -> str:
    fn = tool.get("function") or {}
    entry = {"name": fn.get("name")}
    if fn.get("description"):
        entry["description"] = fn["description"]
    entry["parameters"] = fn.get("parameters") or {"type": "object"}
    return json.dumps(entry, ensure_ascii=False)


def tools_system_text(tools: list[dict], mode: str, name: str | None,
                      parser: str | None) -> str:
    """The system-message text that describes ``tools`` and how to call them."""
    lines = ["You can call these functions (name, description, JSON schema of the "
             "parameters):"]
    lines += [_function_line(t) for t in tools]
    if mode == "named":
        lines.append(f"Call the function {name}: reply with its arguments as one JSON object "
                     "that matches its parameters schema, and nothing else.")
    elif mode == "required":
        lines.append('Call one or more of them: reply with a JSON array of calls, each '
                     '{"name": <function name>, "parameters": <arguments object>}, '
                     "and nothing else.")
    elif parser == "pythonic":
        lines.append("To call functions, reply with a Python list of calls only, like "
                     '[function_name(argument="value")]. Otherwise answer normally.')
    elif parser in (None, "hermes", "qwen"):
        lines.append('To call a function, reply with <tool_call>{"name": <function name>, '
                     '"arguments": <arguments object>}</tool_call>. Otherwise answer '
                     "normally.")
    else:
        lines.append('To call a function, reply with the JSON object {"name": <function '
                     'name>, "arguments": <arguments object>} only. Otherwise answer '
                     "normally.")
    return "\n".join(lines)


def with_tools_fallback(conv: list[dict], tools: list[dict] | None, mode: str,
                        name: str | None, parser: str | None) -> list[dict]:
    """``conv`` with the tools described in its system message and earlier tool calls
    written as text (a new list; the messages given are not changed)."""
    out = []
    for m in conv:
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        if calls:
            text = "".join(
                "<tool_call>" + json.dumps(c.get("function"), ensure_ascii=False)
                + "</tool_call>" for c in calls if isinstance(c, dict))
            m = dict(m, content=(m.get("content") or "") + text)
        out.append(m)
    if not tools or mode == "none":
        return out
    text = tools_system_text(tools, mode, name, parser)
    if out and out[0].get("role") == "system":
        first = out[0].get("content") or ""
        out[0] = dict(out[0], content=f"{first}\n\n{text}" if first else text)
    else:
        out.insert(0, {"role": "system", "content": text})
    return out
