"""``pagefold proxy``: an OpenAI-compatible front for prefill/decode disaggregation.

Each ``/v1/completions`` or ``/v1/chat/completions`` request goes first to a prefill instance
(a ``pagefold serve --kv-transfer-config '{"kv_role": "kv_producer", ...}'``) as the same
request with ``max_tokens=1``, no streaming, ``n=1`` and ``kv_transfer_params:
{"do_remote_decode": true}``; its answer's ``kv_transfer_params`` go with the unchanged request
to a decode instance (a ``kv_consumer``), whose answer, streamed or not, is the client's.
Instances are taken round-robin. A prefill instance that cannot be reached is skipped for the
next one; when every prefill instance fails the decode instance prefills by itself (no
``kv_transfer_params``). A decode instance that cannot be reached, or that drops the
connection before answering, is retried on the next one; when none answers the client gets a
503 (the prefill instance frees the pages nobody pulled after its ``keep_s``). A prefill
instance's 4xx (a bad request) is the client's answer as it stands.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
from collections.abc import AsyncIterator

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger("pagefold.proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
FORWARDED_HEADERS = ("authorization", "x-request-id")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "ServiceUnavailable",
                                   "param": None, "code": status}}, status_code=status)


def prefill_body(body: dict) -> dict:
    """The request a prefill instance gets: one token, no stream, one sample, KV exported."""
    drop = ("stream_options", "best_of", "min_tokens", "use_beam_search", "length_penalty")
    out = {k: v for k, v in body.items() if k not in drop}
    out.update(max_tokens=1, stream=False, n=1,
               kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], timeout: float | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        if not prefill or not decode:
            raise ValueError("pagefold proxy needs at least one --prefill and one --decode URL")
        self.prefill = [u.rstrip("/") for u in prefill]
        self.decode = [u.rstrip("/") for u in decode]
        self._next_prefill = itertools.cycle(range(len(self.prefill)))
        self._next_decode = itertools.cycle(range(len(self.decode)))
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0),
                                        transport=transport)
        self.counts = {"prefill_failed": 0, "decode_retried": 0, "unavailable": 0}

    def _order(self, urls: list[str], cycle) -> list[str]:
        start = next(cycle)
        return urls[start:] + urls[:start]

    async def _prefill(self, path: str, body: dict, headers: dict
                       ) -> tuple[dict | None, Response | None]:
        """(kv_transfer_params or None, or a client error to return as it stands)."""
        for url in self._order(self.prefill, self._next_prefill):
            try:
                r = await self.client.post(url + path, json=prefill_body(body), headers=headers)
            except httpx.HTTPError as e:
                logger.warning("prefill instance %s unreachable (%s); trying the next", url, e)
                self.counts["prefill_failed"] += 1
                continue
            if 400 <= r.status_code < 500:
                return None, Response(r.content, status_code=r.status_code,
                                      media_type="application/json")
            if r.status_code != 200:
                logger.warning("prefill instance %s answered %d; trying the next", url,
                               r.status_code)
                self.counts["prefill_failed"] += 1
                continue
            return r.json().get("kv_transfer_params"), None
        logger.warning("no prefill instance answered; the decode instance prefills itself")
        return None, None

    async def handle(self, path: str, request: Request) -> Response:
        body = await request.json()
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        params, error = await self._prefill(path, body, headers)
        if error is not None:
            return error
        dbody = dict(body)
        if params:
            dbody["kv_transfer_params"] = params
        else:
            dbody.pop("kv_transfer_params", None)
        for url in self._order(self.decode, self._next_decode):
            try:
                req = self.client.build_request("POST", url + path, json=dbody, headers=headers)
                r = await self.client.send(req, stream=True)
            except httpx.HTTPError as e:
                logger.warning("decode instance %s unreachable (%s); trying the next", url, e)
                self.counts["decode_retried"] += 1
                continue
            if not body.get("stream"):
                try:
                    content = await r.aread()
                except httpx.HTTPError as e:
                    logger.warning("decode instance %s dropped the request (%s)", url, e)
                    self.counts["decode_retried"] += 1
                    continue
                finally:
                    await r.aclose()
                return Response(content, status_code=r.status_code,
                                media_type=r.headers.get("content-type", "application/json"))
            return StreamingResponse(self._relay(r), status_code=r.status_code,
                                     media_type=r.headers.get("content-type",
                                                              "text/event-stream"))
        self.counts["unavailable"] += 1
        return _error(503, "no decode instance is reachable")

    async def _relay(self, r: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in r.aiter_raw():
                yield chunk
        finally:
            await r.aclose()

    async def models(self) -> Response:
        for url in self.decode:
            try:
                r = await self.client.get(url + "/v1/models")
                return Response(r.content, status_code=r.status_code,
                                media_type="application/json")
            except httpx.HTTPError:
                continue
        return _error(503, "no decode instance is reachable")


def build_app(proxy: Proxy) -> FastAPI:
    app = FastAPI(title="pagefold proxy", docs_url=None, redoc_url=None)

    for path in ROUTES:
        async def route(request: Request, path: str = path) -> Response:
            return await proxy.handle(path, request)
        app.add_api_route(path, route, methods=["POST"])

    @app.get("/v1/models")
    async def models() -> Response:
        return await proxy.models()

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"prefill": proxy.prefill, "decode": proxy.decode,
                             **proxy.counts})

    return app


def run_proxy(args: argparse.Namespace) -> int:
    proxy = Proxy(args.prefill, args.decode)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per forwarded request
    logger.info("proxy on %s:%d: prefill %s, decode %s", args.host, args.port,
                json.dumps(proxy.prefill), json.dumps(proxy.decode))
    uvicorn.run(build_app(proxy), host=args.host, port=args.port, log_level="warning")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("proxy", help="OpenAI-compatible proxy for prefill/decode "
                                     "disaggregation (prefill instances, then decode instances)")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="base URLs of kv_producer instances, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="base URLs of kv_consumer instances")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.set_defaults(func=run_proxy)
