"""Output memory of the API process: compact JSON bodies, and freed memory given back.

* :func:`json_response` encodes a response straight to bytes with msgspec: one buffer, where
  ``JSONResponse`` builds a ``str`` and then a ``bytes`` copy of it (a large ``n`` x logprobs
  answer would be held three times: the dicts, the text, the bytes).
* :class:`MemoryTrimmer`: CPython frees a finished request's objects at once, but glibc keeps
  the freed heap pages mapped, so the process's RSS stays at its burst peak. When the server
  turns idle after handling requests, :meth:`MemoryTrimmer.idle` runs ``malloc_trim(0)`` (at
  most once per ``min_interval`` seconds, in a thread), which returns them to the OS. No-op
  where glibc is absent.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import time

import msgspec
from starlette.responses import Response

logger = logging.getLogger("pagefold.server")

_encoder = msgspec.json.Encoder()


def json_response(content: object, status_code: int = 200) -> Response:
    """``content`` as compact UTF-8 JSON, encoded once into the body buffer."""
    return Response(_encoder.encode(content), status_code=status_code,
                    media_type="application/json")


def _malloc_trim():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


class MemoryTrimmer:
    """Give freed heap memory back to the OS when the server turns idle."""

    def __init__(self, min_interval: float = 1.0) -> None:
        self.min_interval = min_interval
        self._trim = _malloc_trim()
        self._last = 0.0
        self._task: asyncio.Task | None = None
        self.num_trims = 0

    def trim_now(self) -> None:
        gc.collect()
        if self._trim is not None:
            self._trim(0)
        self.num_trims += 1

    def idle(self) -> None:
        """Call on the event loop when no request is in flight."""
        now = time.monotonic()
        if self._task is not None and not self._task.done():
            return
        if now - self._last < self.min_interval:
            # Too soon after the last trim: try again once the interval has passed.
            delay = self.min_interval - (now - self._last)
        else:
            delay = 0.0
        self._task = asyncio.ensure_future(self._run(delay))

    async def _run(self, delay: float) -> None:
        if delay:
            await asyncio.sleep(delay)
        self._last = time.monotonic()
        await asyncio.get_running_loop().run_in_executor(None, self.trim_now)
