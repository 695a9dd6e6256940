"""Errors the OpenAI-compatible server answers: :class:`APIError` and OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``.

The lowest module of the server: request parsing (``protocol``), number checks
(``validation``) and every handler raise these.
"""

from __future__ import annotations

import json

from pydantic import ValidationError
from starlette.responses import JSONResponse

__all__ = ["APIError", "bad_request", "error_body", "validation_error"]

_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
                404: "invalid_request_error", 405: "invalid_request_error",
                413: "invalid_request_error", 422: "invalid_request_error",
                499: "invalid_request_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error answered to the client as ``status`` with an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:  # noqa: A002
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _ERROR_TYPES.get(status, "invalid_request_error")

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code),
                            status_code=self.status)


def error_body(message: str, type: str = "invalid_request_error",  # noqa: A002
               param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code or "invalid_value")


def validation_error(exc: ValidationError) -> APIError:
    """A 400 naming the first offending field (``param``) and every problem found."""
    problems, param = [], None
    for err in exc.errors()[:4]:
        loc = [str(x) for x in err.get("loc", ())]
        field = loc[0] if loc else None
        param = param or field
        where = ".".join(loc) if loc else "body"
        value = err.get("input")
        shown = "" if isinstance(value, dict) else f" (got {json.dumps(value)[:80]})"
        problems.append(f"{where}: {err.get('msg', 'invalid')}{shown}")
    return bad_request("invalid request: " + "; ".join(problems), param)


