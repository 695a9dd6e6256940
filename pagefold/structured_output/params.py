"""What a request constrains its output to (vLLM's ``StructuredOutputsParams`` names)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """Exactly one of the constraint fields is set.

    Attributes:
        json: a JSON schema (dict or JSON text); the output is a JSON value matching it.
        json_object: any JSON object (OpenAI's ``response_format: json_object``).
        regex: the output matches this regular expression.
        choice: the output is exactly one of these strings.
        grammar: an EBNF (GBNF-style) grammar whose ``root`` rule the output matches.
        structural_tag: xgrammar structural-tag JSON text (tool-call formats).
        disable_any_whitespace: JSON without free whitespace between tokens (compact). JSON
            constraints are compact unless this is explicitly ``False``: small models given
            free whitespace often emit it until ``max_tokens``.
        whitespace_pattern, disable_fallback, disable_additional_properties: vLLM fields,
            accepted (the only backend here is xgrammar; additional properties follow the
            schema).
    """

    json: str | dict | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool | None = None
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, json_object, regex, choice, "
                f"grammar, structural_tag; got {set_ or 'none'}")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings")
            self.choice = list(self.choice)
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(parsed, dict | bool):
                raise ValueError("structured_outputs.json must be a JSON schema object")
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError("structured_outputs.json must be a JSON schema (object or text)")
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported by the "
                             "xgrammar backend")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str, bool]:
        """A hashable identity of the constraint (the compile cache's key)."""
        kind = self.kind
        value: Any = getattr(self, kind)
        if kind == "json":
            # Key order kept: it is the order of the generated properties (as OpenAI's).
            value = json.dumps(json.loads(value) if isinstance(value, str) else value)
        elif kind == "choice":
            value = json.dumps(value)
        elif kind == "json_object":
            value = ""
        return kind, value, self.disable_any_whitespace is not False
