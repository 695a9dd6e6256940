"""Graceful shutdown of ``pagefold serve`` on SIGTERM / SIGINT.

uvicorn's own handling closes the listening socket, waits, then cancels whatever still runs:
clients in flight get a plain-text 500 or a stream cut without an error event, and every
cancelled handler logs a traceback. Here the first signal starts a :class:`Drain` instead:

1. new requests are refused with an OpenAI-style 503 (the gate middleware; ``/health``
   answers 503 ``draining`` so a load balancer stops routing here);
2. requests in flight get ``timeout`` seconds to finish normally;
3. then the engine client shuts down, which fails each request still waiting on the engine
   with ``EngineDeadError``: a non-streaming request is answered 503 with an error body, a
   stream ends with an SSE error event and ``data: [DONE]``; the handlers get up to
   ``FINISH_GRACE`` seconds to write that;
4. uvicorn is told to exit (its own graceful timeout is short: nothing is left to wait for).

The process exits 0 within ``timeout`` + about 2 s, with no traceback. A second signal
during the drain exits at once (uvicorn's path).
"""

from __future__ import annotations

import asyncio
import logging
import time

import uvicorn

from pagefold.entrypoints.openai.middleware import InFlight

logger = logging.getLogger("pagefold.server")

# Seconds the handlers get to write their 503 / SSE error after the engine is stopped.
FINISH_GRACE = 1.0
# uvicorn's own graceful-shutdown timeout once the drain is over.
UVICORN_GRACE = 1.0


class Drain:
    """The shutdown sequence of the module docstring; ``inflight`` is the gate's counter."""

    def __init__(self, inflight: InFlight, client, timeout: float) -> None:
        self.inflight = inflight
        self.client = client
        self.timeout = timeout
        self.task: asyncio.Task | None = None
        self._stopping: asyncio.Future | None = None  # the engine client's shutdown

    @property
    def draining(self) -> bool:
        return self.inflight.draining

    async def run(self, server: uvicorn.Server) -> None:
        self.inflight.draining = True
        start = time.monotonic()
        logger.info("shutdown: refusing new requests, draining %d in flight for up to %.1f s",
                    self.inflight.active, self.timeout)
        try:
            while self.inflight.active > 0 and time.monotonic() - start < self.timeout:
                await asyncio.sleep(0.02)
            if self.inflight.active:
                logger.warning("shutdown: %d request(s) still running after %.1f s; ending "
                               "them with 503 / an SSE error event", self.inflight.active,
                               self.timeout)
            # Fails every request still on the engine at once; the core's exit is awaited
            # in the background (uvicorn's lifespan shutdown waits for it to finish).
            stopping = asyncio.ensure_future(self.client.shutdown(timeout=1.0,
                                                                  term_timeout=0.5))
            grace = time.monotonic() + FINISH_GRACE
            while self.inflight.active > 0 and time.monotonic() < grace:
                await asyncio.sleep(0.02)
            logger.info("shutdown: requests ended after %.2f s (%d still writing); stopping "
                        "the server", time.monotonic() - start, self.inflight.active)
            self._stopping = stopping
        except Exception:  # noqa: BLE001 - never leave the server running on a drain error
            logger.exception("shutdown: drain failed; exiting anyway")
        finally:
            server.should_exit = True


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM / SIGINT runs :class:`Drain` (not re-raised at
    exit, so the process ends with status 0); a second one exits at once."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)

    def handle_exit(self, sig, frame) -> None:
        if self.drain.task is not None or self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        # In a signal handler: only schedule (call_soon_threadsafe is signal-safe).
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self.drain.task is None:
            self.drain.task = asyncio.ensure_future(self.drain.run(self))
