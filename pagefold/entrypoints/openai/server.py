"""``pagefold serve``: an OpenAI-compatible HTTP server over an EngineCore process.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /health``, ``GET /metrics``, ``POST /tokenize``, ``POST /detokenize``, ``GET /version``,
``GET /load`` (generation requests in flight, vLLM's server load), ``GET /tokenizer_info``
(with ``--enable-tokenizer-info-endpoint``) and ``GET /v1/admin/pool`` (pool and queue
counters, for tests and operators).

Process model: this (API) process tokenizes, renders chat templates, detokenizes and
streams; the scheduler and the model run in the EngineCore child process
(:class:`~pagefold.engine.client.AsyncEngineClient`). The engine starts before uvicorn binds
the port, so ``/health`` answers only once the engine is ready; uvicorn's lifespan shutdown
(SIGINT / SIGTERM) stops the core, and a last-resort kill runs on any other exit.

Errors always have OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for
malformed JSON and invalid fields, 401 for a missing/wrong API key (every route but ``/health``,
and ``/metrics`` unless ``--metrics-require-key``), 404 for an unknown model or route, 413 for
a body over ``--max-request-bytes``, 503 while the engine core is dead or the server drains.
Tokenizing and detokenizing run in a thread pool (``tokenizing``), never on the event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from pagefold import __version__
from pagefold.architectures import resolve_architecture
from pagefold.checkpoint import (
    generation_eos_ids,
    load_hf_config,
    load_tokenizer,
    read_config_dict,
)
from pagefold.config import EngineConfig
from pagefold.engine.client import AsyncEngineClient, EngineDeadError
from pagefold.engine.dp_client import DPEngineClient
from pagefold.entrypoints.openai.engine_calls import ClientDisconnected
from pagefold.entrypoints.openai.errors import APIError, bad_request, error_body
from pagefold.entrypoints.openai.lora_modules import (
    LoRAModules,
    add_lora_routes,
    parse_lora_modules,
)
from pagefold.entrypoints.openai.memory import MemoryTrimmer
from pagefold.entrypoints.openai.middleware import GateMiddleware, InFlight
from pagefold.entrypoints.openai.options import ServeOptions, serve_options, stats_loop
from pagefold.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_request,
)
from pagefold.entrypoints.openai.serving_chat import OpenAIServingChat
from pagefold.entrypoints.openai.serving_completion import (
    DEFAULT_MAX_REQUEST_OUTPUT_TOKENS,
    OpenAIServingCompletion,
)
from pagefold.entrypoints.openai.tokenizing import TokenizerPool
from pagefold.generation_defaults import generation_defaults, log_generation_defaults
from pagefold.metrics import CONTENT_TYPE, ServerMetrics
from pagefold.multimodal.processor import ImageInputProcessor, image_processor_for

logger = logging.getLogger("pagefold.server")

# Default --max-request-bytes: room for any prompt that fits a long context as text or ids.
DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20
DEFAULT_SHUTDOWN_TIMEOUT = 10.0


@dataclass
class ServerState:
    """Everything the routes share; ``client`` must be started before serving."""

    client: AsyncEngineClient
    tokenizer: object
    served_model_name: str
    model_path: str
    metrics: ServerMetrics
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    api_key: str | None = None
    created: int = 0
    options: ServeOptions = field(default_factory=ServeOptions)
    # 0 = no limit. Checked by GateMiddleware while the body is read (413).
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    # /metrics behind the API key too (it is open by default, for scrapers).
    metrics_require_key: bool = False
    tokens: TokenizerPool | None = None
    # Seconds in-flight requests get to finish after SIGTERM (see ``shutdown``).
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    inflight: InFlight = field(default_factory=InFlight)
    trimmer: MemoryTrimmer = field(default_factory=MemoryTrimmer)

    def __post_init__(self) -> None:
        self.inflight.on_idle = self.trimmer.idle  # RSS back down after a burst


def _image_processor(config: EngineConfig) -> ImageInputProcessor | None:
    """The chat endpoint's image input processor (None for a model without images)."""
    arch, hf_config = load_hf_config(config.model)
    limits = config.limit_mm_per_prompt or {}
    return image_processor_for(config.model, hf_config, arch, limits.get("image"),
                               config.allowed_local_media_path)


def build_state(config: EngineConfig, *, served_model_name: str | list[str] | None = None,
                api_key: str | None = None, chat_template: str | None = None,
                log_level: str = "INFO", client: AsyncEngineClient | None = None,
                options: ServeOptions | None = None,
                max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                metrics_require_key: bool = False,
                max_request_output_tokens: int = DEFAULT_MAX_REQUEST_OUTPUT_TOKENS,
                lora_modules: list[str] | None = None
                ) -> ServerState:
    """Load the tokenizer and wire the engine client (not started yet; pass one that was
    already spawned to overlap the model load with this) and the handlers."""
    names = ([served_model_name] if isinstance(served_model_name, str)
             else list(served_model_name or []))
    name = names[0] if names else config.model
    options = options or ServeOptions()
    options.served_model_names = names or [name]
    options.default_sampling = generation_defaults(config.model, config.generation_config)
    options.kv_transfer = config.kv_transfer_config is not None
    if lora_modules and not config.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if config.enable_lora:
        options.lora = LoRAModules(config, options.served_model_names)
        for lora_name, lora_path in parse_lora_modules(lora_modules):
            try:
                options.lora.add(lora_name, lora_path)
            except APIError as e:
                raise ValueError(f"--lora-modules {lora_name}={lora_path}: {e}") from None
    log_generation_defaults(options.default_sampling, config.generation_config)
    metrics = ServerMetrics(name)
    if client is None:
        client = AsyncEngineClient(config, log_level=log_level)
    client.metrics = metrics
    tokenizer = load_tokenizer(config.tokenizer or config.model)
    client.tokenizer = tokenizer
    extra = generation_eos_ids(config.model)
    tokens = TokenizerPool(tokenizer)
    common = dict(extra_eos_ids=extra, options=options, tokens=tokens,
                  max_request_output_tokens=max_request_output_tokens)
    template = None
    if chat_template is not None:
        p = Path(chat_template)
        template = p.read_text() if p.is_file() else chat_template
    return ServerState(
        client=client, tokenizer=tokenizer, served_model_name=name, model_path=config.model,
        metrics=metrics, api_key=api_key, created=int(time.time()), options=options,
        tokens=tokens, max_request_bytes=max_request_bytes,
        metrics_require_key=metrics_require_key,
        completion=OpenAIServingCompletion(client, tokenizer, name, **common),
        chat=OpenAIServingChat(client, tokenizer, name, chat_template=template,
                               mm_processor=_image_processor(config), **common))


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI app. Its lifespan stops the engine client on shutdown (it must already be
    started, see :func:`serve`)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            await state.client.shutdown()

    app = FastAPI(title="pagefold", version=__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url="/openapi.json")
    app.state.pagefold = state
    client = state.client

    app.add_middleware(GateMiddleware, api_key=state.api_key,
                       max_request_bytes=state.max_request_bytes,
                       metrics_require_key=state.metrics_require_key,
                       inflight=state.inflight)
    tokens = state.tokens or state.completion.tokens

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return bad_request(f"invalid request: {exc.errors()[:3]}").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        msg = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            msg = f"no route {request.method} {request.url.path}"
        return APIError(exc.status_code, msg, code=f"http_{exc.status_code}").response()

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect):
        # The client left while its body was being read: nobody to answer, nothing to log.
        return Response(status_code=499)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError):
        return APIError(503, f"the engine is not available: {exc}",
                        code="engine_unavailable").response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    async def body(request: Request) -> bytes:
        return await request.body()

    async def json_body(request: Request) -> dict:
        try:
            data = json.loads(await body(request) or b"{}")
        except ValueError:
            raise bad_request("the body is not JSON") from None
        if not isinstance(data, dict):
            raise bad_request("the body must be a JSON object")
        return data

    if state.options.lora is not None:
        add_lora_routes(app, state.options.lora, json_body)

    # ------------------------------------------------------------------ service routes
    @app.get("/health")
    async def health() -> Response:
        info = {"engine_core_pid": client.core_pid, "num_in_flight": client.num_in_flight}
        if state.inflight.draining:
            return JSONResponse(dict(error_body("the server is shutting down", "server_error",
                                                None, "server_shutting_down"),
                                     status="draining", **info), status_code=503)
        if client.is_alive:
            return JSONResponse(dict(status="ok", **info))
        reason = client.dead_reason or "the engine core is not running"
        return JSONResponse(dict(error_body(reason, "server_error", None, "engine_unavailable"),
                                 status="dead", **info), status_code=503)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @app.get("/load")
    async def load() -> Response:
        # vLLM's server load: generation requests inside the app now (GateMiddleware).
        return JSONResponse({"server_load": state.inflight.generating})

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        if not state.options.tokenizer_info:
            raise APIError(404, "GET /tokenizer_info is off; start the server with "
                           "--enable-tokenizer-info-endpoint", code="http_404")
        return JSONResponse(describe_tokenizer(state.tokenizer))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": state.served_model_name, "object": "model", "created": state.created,
            "owned_by": "pagefold", "root": state.model_path,
            "max_model_len": client.info.max_model_len}] + (
                state.options.lora.cards(state.served_model_name, state.created)
                if state.options.lora is not None else [])})

    @app.get("/v1/admin/pool")
    async def admin_pool() -> Response:
        stats = await client.utility("pool_stats")
        stats["num_in_flight_api"] = client.num_in_flight
        return JSONResponse(stats)

    # ------------------------------------------------------------------ generation
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse_request(CompletionRequest, await body(request))
        try:
            return await state.completion.create(request, req)
        except ClientDisconnected:
            return Response(status_code=499)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse_request(ChatCompletionRequest, await body(request))
        try:
            return await state.chat.create(request, req)
        except ClientDisconnected:
            return Response(status_code=499)

    # ------------------------------------------------------------------ tokenizer
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = parse_request(TokenizeRequest, await body(request))
        state.completion.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if req.prompt is not None:
            ids = await tokens.encode(req.prompt, add_special_tokens=req.special_tokens())
        else:
            add_gen = req.add_generation_prompt and not req.continue_final_message
            _, ids = await state.chat.render_async(
                req.messages, add_generation_prompt=add_gen,
                continue_final_message=req.continue_final_message,
                chat_template_kwargs=req.chat_template_kwargs, tools=req.tools,
                add_special_tokens=req.special_tokens())
        out = {"count": len(ids), "max_model_len": client.info.max_model_len, "tokens": ids,
               "token_strs": None}
        if req.return_token_strs:
            out["token_strs"] = await tokens.run(state.tokenizer.convert_ids_to_tokens, ids)
        return Response(await tokens.run(msgspec.json.encode, out),
                        media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = parse_request(DetokenizeRequest, await body(request))
        state.completion.check_model(req.model)
        vocab = client.info.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids out of range [0, {vocab}): {bad[:5]}", "tokens")
        text = await tokens.decode(req.tokens)
        return Response(await tokens.run(msgspec.json.encode, {"prompt": text}),
                        media_type="application/json")

    return app


def describe_tokenizer(tokenizer) -> dict:
    """vLLM's ``/tokenizer_info``: the tokenizer's init configuration (JSON values only),
    its class and chat template."""

    def plain(v):
        if v is None or isinstance(v, bool | int | float | str):
            return v
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [plain(x) for x in v]
        content = getattr(v, "content", None)  # AddedToken: its text, as vLLM
        return content if isinstance(content, str) else str(v)

    def added(v) -> dict:
        return {"content": str(getattr(v, "content", v)),
                "special": bool(getattr(v, "special", False))}

    info = {k: plain(v) for k, v in getattr(tokenizer, "init_kwargs", {}).items()
            if not k.endswith("_file") and k not in ("name_or_path", "added_tokens_decoder")}
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    info["added_tokens_decoder"] = {str(i): added(t) for i, t in decoder.items()}
    info["tokenizer_class"] = type(tokenizer).__name__
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        info["chat_template"] = template
    return info


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound now: a busy port fails in milliseconds, before any model
    loads (uvicorn then serves on this socket)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}; is another "
                         "server running there? pick another --port") from None
    sock.set_inheritable(True)
    return sock


async def serve(state: ServerState, host: str, port: int, *,
                uvicorn_log_level: str = "info", sock: socket.socket | None = None) -> None:
    """Start the engine, then serve until SIGINT/SIGTERM (a graceful drain, see
    ``shutdown``); the engine is always stopped."""
    import uvicorn

    from pagefold.entrypoints.openai.shutdown import UVICORN_GRACE, Drain, DrainingServer

    await state.client.start()
    info = state.client.info
    logger.info("engine core %d ready: max_model_len %d, %d usable blocks", info.pid,
                info.max_model_len, info.num_usable_blocks)
    cfg = state.client.config
    state.metrics.set_cache_config({
        "block_size": str(cfg.block_size), "cache_dtype": str(cfg.kv_cache_dtype),
        "enable_prefix_caching": str(cfg.enable_prefix_caching),
        "gpu_memory_utilization": str(cfg.gpu_memory_utilization),
        "num_gpu_blocks": str(info.num_usable_blocks)})
    app = build_app(state)
    opts = state.options
    config = uvicorn.Config(app, host=host, port=port, log_level=uvicorn_log_level,
                            timeout_graceful_shutdown=UVICORN_GRACE,
                            timeout_keep_alive=keep_alive_seconds(),
                            access_log=opts.access_log)
    server = DrainingServer(config, Drain(state.inflight, state.client, state.shutdown_timeout))
    stats = (asyncio.ensure_future(stats_loop(state.metrics, opts.log_stats_interval))
             if opts.log_stats and opts.log_stats_interval > 0 else None)
    try:
        await server.serve(sockets=[sock] if sock is not None else None)
    finally:
        if stats is not None:
            stats.cancel()
        await state.client.shutdown()
        if state.tokens is not None:
            state.tokens.shutdown()


KEEP_ALIVE_ENV = "PAGEFOLD_HTTP_TIMEOUT_KEEP_ALIVE"


def keep_alive_seconds() -> int:
    """Seconds an idle HTTP keep-alive connection stays open (``$PAGEFOLD_HTTP_TIMEOUT_KEEP_ALIVE``,
    default 5 as uvicorn's and vLLM's). A client that reuses a pooled connection just as the
    server closes it sees a connection reset, so clients with long pauses raise it."""
    raw = os.environ.get(KEEP_ALIVE_ENV, "5")
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise SystemExit(f"${KEEP_ALIVE_ENV} must be a whole number of seconds >= 1, got {raw!r}")
    return value


def run_server(args: argparse.Namespace, engine_kwargs: dict) -> int:
    """Entry point of ``pagefold serve`` (``engine_kwargs`` from ``cli.engine_kwargs``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    keep_alive_seconds()  # a bad value fails before the model loads
    config = EngineConfig(model=args.model, tokenizer=args.tokenizer, **engine_kwargs)
    # Cheap checks first, each naming what is wrong: the model's config, then the port.
    resolve_architecture(read_config_dict(Path(args.model)))
    sock = bind_socket(args.host, args.port)  # before the model loads: fail fast on a busy port
    options = serve_options(args)
    dp = getattr(args, "data_parallel_size", 1) or 1
    if dp > 1:
        client = DPEngineClient(config, dp, log_level=getattr(args, "log_level", "INFO"))
    else:
        client = AsyncEngineClient(config, log_level=getattr(args, "log_level", "INFO"))
    client.spawn()  # the core loads the model while this process loads the tokenizer
    try:
        state = build_state(config, served_model_name=args.served_model_name,
                            api_key=args.api_key, chat_template=args.chat_template,
                            client=client, options=options,
                            max_request_bytes=args.max_request_bytes,
                            metrics_require_key=args.metrics_require_key,
                            max_request_output_tokens=args.max_request_output_tokens,
                            lora_modules=getattr(args, "lora_modules", None))
        state.shutdown_timeout = args.shutdown_timeout
        asyncio.run(serve(state, args.host, args.port,
                          uvicorn_log_level=args.uvicorn_log_level, sock=sock))
    except KeyboardInterrupt:
        pass  # a second SIGINT during the drain is re-raised by uvicorn; the engine is stopped
    finally:
        client.kill_now()  # no-op after a clean shutdown; never leave the core behind
        sock.close()
    return 0
