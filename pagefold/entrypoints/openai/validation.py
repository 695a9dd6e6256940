"""Strict numbers for every request the server parses.

JSON as Python reads it allows bare ``NaN``, ``Infinity`` and integers of any size; the
engine takes neither: a NaN temperature samples garbage, and an integer past 64 bits
overflows msgspec on its way to the engine core (a 500). :func:`check_numbers` walks a parsed
request (every field, nested models, lists, dicts, free-form ``Any`` fields too) and answers
400 naming the top-level field for

* a float that is NaN or infinite, wherever it is;
* an integer outside the signed 64-bit range ``[-2**63, 2**63 - 1]``.

Field-specific ranges (``top_p`` in (0, 1], ``seed`` ...) are checked afterwards by
``SamplingParams``; this pass only guarantees that what reaches them is a finite number that
fits the wire.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel

from pagefold.entrypoints.openai.errors import bad_request

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


def check_numbers(req: BaseModel) -> None:
    """Raise :class:`~pagefold.entrypoints.openai.errors.APIError` 400 on the first NaN,
    infinity or out-of-range integer in ``req`` (see the module docstring)."""
    for name, value in _fields(req):
        _check(value, name, name)


def _fields(model: BaseModel):
    for name in type(model).model_fields:
        yield name, getattr(model, name)
    extra = model.model_extra or {}
    yield from extra.items()


def _check(value: Any, param: str, where: str) -> None:
    # bool is an int subclass: it is always in range.
    if isinstance(value, float):
        if not math.isfinite(value):
            raise bad_request(f"{where}: {value} is not a valid number (NaN and Infinity are "
                              "rejected)", param)
    elif isinstance(value, int) and not isinstance(value, bool):
        if not INT64_MIN <= value <= INT64_MAX:
            raise bad_request(f"{where}: integer {_short(value)} is out of range "
                              f"[{INT64_MIN}, {INT64_MAX}]", param)
    elif isinstance(value, BaseModel):
        for name, v in _fields(value):
            _check(v, param, f"{where}.{name}")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check(v, param, f"{where}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            _check(v, param, f"{where}.{k}")


def _short(value: int) -> str:
    text = str(value) if value.bit_length() < 1000 else f"of {value.bit_length()} bits"
    return text if len(text) <= 40 else text[:20] + "..." + text[-8:]
