"""One rule for options that take a dict or its JSON text (``--speculative-config``,
``--kv-transfer-config``, ``--limit-mm-per-prompt``): the same parse and the same errors."""

from __future__ import annotations

import json
from typing import Any


def json_object(value: dict[str, Any] | str, name: str) -> dict[str, Any]:
    """``value`` as a dict: a dict is returned as is, a string is parsed as JSON. Raises
    ``ValueError`` naming the option ``name`` for text that is not JSON and for any value that
    is not (or does not parse to) a JSON object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict or a JSON object, got {type(value).__name__}")
    return value
