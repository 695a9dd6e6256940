"""Tool calls read out of generated JSON while it grows: OpenAI's streamed tool-call deltas.

:class:`JsonCallScanner` is fed the growing text of one JSON value -- a call object
``{"name": ..., "arguments" | "parameters": ...}`` or an array of them -- and reads each
character once. For every call object it records the name (once its string is complete) and
where the arguments value starts and ends in the text.

:class:`ToolCallStream` turns what the scanners found into deltas the way OpenAI sends them:
the first delta of call ``i`` is ``{"index": i, "id", "type": "function", "function":
{"name", "arguments": ""}}``, the later ones ``{"index": i, "function": {"arguments":
piece}}``; the pieces of a call concatenate to its arguments JSON. :meth:`ToolCallStream.finish`
sends whatever the final parse found and the stream did not (a call the scanner could not
follow, arguments given as a JSON string, a call without arguments).

Invariants: a call's header goes out only once its name is known, and calls go out in order
(call ``i + 1`` waits for call ``i``'s name); argument text sent is never taken back (what is
sent is a prefix of the arguments' raw JSON text, whitespace included).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pagefold.entrypoints.openai.chat_parsing import ToolCall

ARG_KEYS = ("arguments", "parameters")


@dataclass(slots=True)
class CallSpan:
    """One call object seen by a scanner; offsets index the scanner's text."""

    name: str | None = None
    args_start: int = -1  # where the arguments value starts; -1: not seen yet
    args_end: int = -1  # one past its end; -1 while it is still open
    args_is_string: bool = False  # arguments given as a JSON string holding JSON


class JsonCallScanner:
    """Follows one JSON value (a call object or an array of call objects) character by
    character; :attr:`calls` grows as call objects open. Text after the value ends is
    ignored; text that is not a call (a bare string, an array of numbers) gives no calls."""

    def __init__(self) -> None:
        self.text = ""
        self.calls: list[CallSpan] = []
        self.done = False  # the top-level value is complete
        self._stack: list[str] = []
        self._in_str = False
        self._esc = False
        self._str_start = -1
        self._str_role = ""  # "key" / "value" (call level) / "" (anything else)
        self._level = 0  # stack depth inside the open call object; 0: none open
        self._state = ""  # at call level: key / colon / value / in_value / next
        self._key: str | None = None
        self._value_start = -1
        self._scalar = False  # a number / literal value at call level is open

    def feed_to(self, text: str) -> None:
        """Read ``text``, which extends what was read before (anything else is ignored)."""
        if not text.startswith(self.text):
            return
        start, self.text = len(self.text), text
        for i in range(start, len(text)):
            if self.done:
                return
            self._char(i, text[i])

    # ------------------------------------------------------------------ internals
    def _at_call_level(self) -> bool:
        return self._level > 0 and len(self._stack) == self._level

    def _start_value(self, i: int, c: str) -> None:
        self._state, self._value_start = "in_value", i
        if self._key in ARG_KEYS:
            call = self.calls[-1]
            call.args_start, call.args_end, call.args_is_string = i, -1, c == '"'

    def _end_value(self, end: int) -> None:
        call = self.calls[-1]
        if self._key == "name":
            try:
                name = json.loads(self.text[self._value_start:end])
            except json.JSONDecodeError:
                name = None
            if isinstance(name, str):
                call.name = name
        elif self._key in ARG_KEYS and call.args_start == self._value_start:
            call.args_end = end
        self._state = "next"

    def _char(self, i: int, c: str) -> None:
        if self._in_str:
            if self._esc:
                self._esc = False
            elif c == "\\":
                self._esc = True
            elif c == '"':
                self._in_str = False
                if self._str_role == "key":
                    try:
                        self._key = json.loads(self.text[self._str_start:i + 1])
                    except json.JSONDecodeError:
                        self._key = None
                    self._state = "colon"
                elif self._str_role == "value":
                    self._end_value(i + 1)
                if not self._stack:
                    self.done = True  # a bare string: not a call
            return
        if self._scalar:
            if c not in ",}]" and not c.isspace():
                return
            self._scalar = False
            self._end_value(i)
        if c.isspace():
            return
        call_level = self._at_call_level()
        if c == '"':
            self._in_str, self._str_start = True, i
            self._str_role = ""
            if call_level and self._state == "key":
                self._str_role = "key"
            elif call_level and self._state == "value":
                self._str_role = "value"
                self._start_value(i, c)
        elif c in "{[":
            if call_level and self._state == "value":
                self._start_value(i, c)
            elif c == "{" and self._level == 0 and self._stack in ([], ["["]):
                self.calls.append(CallSpan())
                self._level, self._state, self._key = len(self._stack) + 1, "key", None
            self._stack.append(c)
        elif c in "}]":
            if not self._stack:
                self.done = True
                return
            self._stack.pop()
            if call_level and c == "}":  # the call object closed
                self._level, self._state = 0, ""
            elif self._at_call_level() and self._state == "in_value":
                self._end_value(i + 1)  # a container value at call level closed
            if not self._stack:
                self.done = True
        elif call_level and c == ":" and self._state == "colon":
            self._state = "value"
        elif call_level and c == ",":
            self._state, self._key = "key", None
        elif call_level and self._state == "value":
            self._start_value(i, c)
            self._scalar = True
        elif not self._stack:
            self.done = True  # a bare number or literal: not a call

    def args_text(self, call: CallSpan) -> str | None:
        """The arguments JSON of ``call`` seen so far (raw text; a prefix while open), or
        None when there is nothing to send yet (not started, or a JSON string still open)."""
        if call.args_start < 0:
            return None
        end = call.args_end if call.args_end >= 0 else len(self.text)
        raw = self.text[call.args_start:end]
        if not call.args_is_string:
            return raw if call.args_end >= 0 or not self._scalar else None
        if call.args_end < 0:
            return None
        try:
            inner = json.loads(raw)
        except json.JSONDecodeError:
            return None
        return inner if isinstance(inner, str) else None


class ToolCallStream:
    """The tool-call deltas of one choice. ``max_calls``: 1 with ``parallel_tool_calls``
    false (later calls are never sent)."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.scanners: list[JsonCallScanner] = []
        self.calls: list[ToolCall] = []  # sent headers (id, name), in index order
        self.sent: list[int] = []  # argument characters sent per call

    @property
    def started(self) -> bool:
        return bool(self.calls)

    def _header(self, name: str) -> dict:
        call = ToolCall(name, "")
        self.calls.append(call)
        self.sent.append(0)
        return {"index": len(self.calls) - 1, "id": call.id, "type": "function",
                "function": {"name": name, "arguments": ""}}

    def _args(self, i: int, args: str) -> dict | None:
        if len(args) <= self.sent[i] or not args.startswith(self.calls[i].arguments):
            return None
        piece = args[self.sent[i]:]
        self.calls[i].arguments, self.sent[i] = args, len(args)
        return {"index": i, "function": {"arguments": piece}}

    def feed(self, blocks: list[str]) -> list[dict]:
        """``blocks``: the text so far of each call block (one JSON value each: a block only
        grows, and new blocks come after). Returns the new deltas, in order."""
        for k, text in enumerate(blocks):
            if k == len(self.scanners):
                self.scanners.append(JsonCallScanner())
            self.scanners[k].feed_to(text)
        found = [(s, c) for s in self.scanners for c in s.calls]
        if self.max_calls is not None:
            found = found[:self.max_calls]
        out: list[dict] = []
        for i, (scanner, call) in enumerate(found):
            if call.name is None:
                break
            if i == len(self.calls):
                out.append(self._header(call.name))
            args = scanner.args_text(call)
            delta = self._args(i, args) if args is not None else None
            if delta is not None:
                out.append(delta)
        return out

    def named(self, name: str, args: str) -> list[dict]:
        """Named ``tool_choice``: the whole output is the arguments of one call."""
        out = [self._header(name)] if not self.calls else []
        delta = self._args(0, args)
        return out + ([delta] if delta is not None else [])

    def finish(self, final: list[ToolCall]) -> list[dict]:
        """Send what the final parse found beyond what was streamed: calls the scanner
        missed (whole), and the arguments of streamed calls that got none (e.g. ``"{}"``
        for a call without arguments, or arguments given as a JSON string)."""
        if self.max_calls is not None:
            final = final[:self.max_calls]
        out: list[dict] = []
        for i, call in enumerate(final):
            if i >= len(self.calls):
                out.append(self._header(call.name))
            if self.sent[i] == 0:
                delta = self._args(i, call.arguments)
                if delta is not None:
                    out.append(delta)
        return out
