"""The server's gate: one plain ASGI middleware in front of every route.

In order, for each HTTP request:

1. while the server drains for shutdown (``InFlight.draining``, set by
   :class:`~pagefold.entrypoints.openai.shutdown.Drain`), every new request except
   ``GET /health`` is answered 503 at once;
2. with an API key, every route needs ``Authorization: Bearer <key>`` (401 otherwise) except
   ``/health``, and ``/metrics`` unless ``metrics_require_key``; unknown paths are behind the
   key too, so a scanner learns nothing about the routes;
3. the body is limited to ``max_request_bytes``: a ``Content-Length`` above it is answered 413
   before anything is read, and a chunked body is counted while it is read and cut with a 413
   the moment it passes the limit -- nothing is parsed or tokenized first.

Nothing is buffered here and streams pass untouched. The middleware also counts the requests
in progress (``/health`` and ``/metrics`` excepted), which the drain waits on.
"""

from __future__ import annotations

import secrets

from starlette.responses import JSONResponse

from pagefold.entrypoints.openai.errors import APIError, error_body

# Routes that answer without the key (``/metrics`` only unless metrics_require_key).
OPEN_PATHS = ("/health",)
# Routes whose requests count as server load (GET /load), as vLLM counts them.
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


class RequestTooLarge(APIError):
    """The body passed ``--max-request-bytes`` (413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than the server's limit of {limit} "
                         "bytes (--max-request-bytes)", code="request_too_large")


def unauthorized() -> JSONResponse:
    return JSONResponse(error_body("Incorrect or missing API key: send 'Authorization: Bearer "
                                   "<key>'.", "invalid_request_error", None, "invalid_api_key"),
                        status_code=401)


class InFlight:
    """What the gate shares with the shutdown drain: requests inside the app now (service
    routes excepted) and whether new ones are refused."""

    __slots__ = ("active", "draining", "generating", "on_idle")

    def __init__(self, on_idle=None) -> None:
        self.active = 0
        # Generation requests (completions / chat) inside the app now: vLLM's server load.
        self.generating = 0
        self.draining = False
        self.on_idle = on_idle  # called when ``active`` drops back to 0


class GateMiddleware:
    """Draining, API key and body limit (see the module docstring)."""

    def __init__(self, app, *, api_key: str | None = None, max_request_bytes: int = 0,
                 metrics_require_key: bool = False, inflight: InFlight | None = None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.limit = max_request_bytes
        self.open_paths = OPEN_PATHS if metrics_require_key else OPEN_PATHS + ("/metrics",)
        self.inflight = inflight if inflight is not None else InFlight()

    def authorized(self, scope) -> bool:
        if self.key is None or scope["path"] in self.open_paths:
            return True
        header = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.key)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if self.inflight.draining and path != "/health":
            await APIError(503, "the server is shutting down; retry on another replica",
                           code="server_shutting_down").response()(scope, receive, send)
            return
        if not self.authorized(scope):
            await unauthorized()(scope, receive, send)
            return
        if self.limit > 0:
            length = _content_length(scope)
            if length is not None and length > self.limit:
                await RequestTooLarge(self.limit).response()(scope, receive, send)
                return
            receive = _limited(receive, self.limit)
        service = path in ("/health", "/metrics")
        started = False

        async def send_tracked(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        generation = path in GENERATION_PATHS
        if not service:
            self.inflight.active += 1
        if generation:
            self.inflight.generating += 1
        try:
            await self.app(scope, receive, send_tracked)
        except RequestTooLarge as e:
            # Raised while a route outside FastAPI's handlers read the body.
            if started:
                raise
            await e.response()(scope, receive, send)
        finally:
            if generation:
                self.inflight.generating -= 1
            if not service:
                self.inflight.active -= 1
                if self.inflight.active == 0 and self.inflight.on_idle is not None:
                    self.inflight.on_idle()


def _content_length(scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _limited(receive, limit: int):
    """``receive`` that raises :class:`RequestTooLarge` once the body passes ``limit``."""
    seen = 0

    async def wrapped():
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise RequestTooLarge(limit)
        return message

    return wrapped
