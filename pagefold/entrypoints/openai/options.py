"""Server options beyond the engine's: request logging, the periodic stats line, tool and
reasoning parsers, sampling defaults. Kept apart from ``server.py`` so each piece stays small.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pagefold.entrypoints.openai.chat_parsing import REASONING_PARSERS, TOOL_PARSERS
from pagefold.metrics import ServerMetrics, stats_line

logger = logging.getLogger("pagefold.server")


@dataclass
class ServeOptions:
    """What ``pagefold serve``'s non-engine flags decide (defaults = the flags' defaults).

    ``served_model_names``: every name a request may send (the first one is reported).
    ``default_sampling``: sampling fields taken when a request leaves them out (from the
    checkpoint's generation_config.json unless ``--generation-config vllm``)."""

    served_model_names: list[str] = field(default_factory=list)
    log_requests: bool = False
    max_log_len: int | None = None
    log_stats: bool = False
    log_stats_interval: float = 10.0
    access_log: bool = False
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    default_sampling: dict = field(default_factory=dict)
    # Usage in every stream chunk and a final usage chunk, whatever stream_options say.
    force_include_usage: bool = False
    # Logprob token strings as "token_id:N" unless the request says otherwise.
    return_tokens_as_token_ids: bool = False
    # The engine has a kv_transfer_config: requests may carry kv_transfer_params.
    kv_transfer: bool = False
    tokenizer_info: bool = False
    # --enable-lora: the adapters a request's ``model`` may name (lora_modules.LoRAModules).
    lora: Any = None


def serve_options(args) -> ServeOptions:
    """ServeOptions from ``pagefold serve``'s parsed flags (missing flags: defaults)."""
    d = ServeOptions()
    opts = ServeOptions(
        log_requests=getattr(args, "log_requests", d.log_requests),
        max_log_len=getattr(args, "max_log_len", d.max_log_len),
        log_stats=getattr(args, "log_stats", d.log_stats),
        log_stats_interval=getattr(args, "log_stats_interval", d.log_stats_interval),
        access_log=getattr(args, "access_log", d.access_log),
        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        reasoning_parser=getattr(args, "reasoning_parser", None),
        force_include_usage=bool(getattr(args, "enable_force_include_usage", False)),
        return_tokens_as_token_ids=bool(getattr(args, "return_tokens_as_token_ids", False)),
        tokenizer_info=bool(getattr(args, "enable_tokenizer_info_endpoint", False)))
    if opts.tool_call_parser is not None and opts.tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, got "
                         f"{opts.tool_call_parser!r}")
    if opts.reasoning_parser is not None and opts.reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, "
                         f"got {opts.reasoning_parser!r}")
    if opts.enable_auto_tool_choice and not opts.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    return opts


def stream_usage(opts: ServeOptions, stream_options) -> tuple[bool, bool]:
    """``(usage chunk at the end, usage in every chunk)`` of a stream: what
    ``stream_options`` ask, or both with ``--enable-force-include-usage`` (as vLLM)."""
    if opts.force_include_usage:
        return True, True
    include = bool(stream_options and stream_options.include_usage)
    return include, include and bool(stream_options.continuous_usage_stats)


def log_request(opts: ServeOptions, request_id: str, prompt: str | None, ids: list[int],
                params) -> None:
    """One line per accepted request when ``--enable-log-requests`` (vLLM's format)."""
    if not opts.log_requests:
        return
    n = opts.max_log_len
    shown_prompt = prompt if prompt is None or n is None else prompt[:n]
    shown_ids = ids if n is None else ids[:n]
    logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s",
                request_id, shown_prompt, params, shown_ids)


def log_finished(opts: ServeOptions, request_id: str, finish_reasons: list, num_tokens: int
                 ) -> None:
    if opts.log_requests:
        logger.info("Finished request %s: finish_reason %s, %d output tokens", request_id,
                    finish_reasons, num_tokens)


async def stats_loop(metrics: ServerMetrics, interval: float) -> None:
    """Log :func:`~pagefold.metrics.stats_line` every ``interval`` seconds until cancelled."""
    prev, t = metrics.snapshot(), time.monotonic()
    while True:
        await asyncio.sleep(interval)
        cur, now = metrics.snapshot(), time.monotonic()
        if cur != prev or cur["running"] or cur["waiting"]:  # an idle server stays quiet
            logger.info("%s", stats_line(prev, cur, now - t))
        prev, t = cur, now
