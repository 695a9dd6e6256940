"""Server options beyond the engine's: request logging, the periodic stats line, tool and
reasoning parsers, sampling defaults. Kept apart from ``server.py`` so each piece stays small.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

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
        logger.info("%s", stats_line(prev, cur, now - t))
        prev, t = cur, now
