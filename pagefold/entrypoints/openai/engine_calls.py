"""Awaiting the engine for an HTTP client: racing the client's disconnect, interleaving
several engine streams, and the engine's failures as HTTP errors (400 rejected, 503 dead).

Shared by the completion and chat handlers and the server's beam search; it imports none
of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from starlette.requests import Request

from pagefold.engine.client import EngineDeadError, RequestRejectedError
from pagefold.entrypoints.openai.errors import APIError, bad_request
from pagefold.outputs import RequestOutput

__all__ = ["ClientDisconnected", "engine_error", "merge_generations", "race_disconnect"]

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away before the answer was ready."""


async def _wait_for_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(raw: Request, aw: Awaitable[T]) -> T:
    """Await ``aw`` unless the client disconnects first: then cancel it (which aborts the
    engine requests inside) and raise :class:`ClientDisconnected`. The body must be read."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def merge_generations(
        gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several engine streams as ``(index, output)``; the first error wins.

    Closing this generator (or an error) cancels every stream, which aborts its request.
    """
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                queue.put_nowait((i, out))
            queue.put_nowait((i, done))
        except Exception as e:  # noqa: BLE001 - forwarded to the consumer
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def engine_error(e: Exception) -> APIError:
    """Map engine-side failures to HTTP errors (400 rejected, 503 dead)."""
    if isinstance(e, RequestRejectedError):
        msg = str(e)
        return bad_request(msg, "structured_outputs" if "structured output" in msg
                           else "prompt")
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the engine is not available: {e}", code="engine_unavailable")
    if isinstance(e, APIError):
        return e
    raise e
