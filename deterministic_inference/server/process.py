"""The `detinf serve` process: the engine built before the port is bound, uvicorn with a bounded
shutdown, a bounded exit after an engine failure, and the package's logging.

Start-up (`serve_when_engine_ready`): the engine thread builds the engine (model load, self-check) first;
only once it is ready does uvicorn start, bind the port and log its start-up lines. A model or engine
that cannot start therefore ends the command before any of those, the port never bound, with the reason
in one line (the caller prints it). A signal during the build ends the command without serving.

Shutdown on SIGTERM/SIGINT: the engine stops admitting at once (`on_exit_signal`) and gives in-flight
requests `shutdown_timeout` seconds, then aborts the rest, freeing their KV blocks (logged, with the
counts); uvicorn closes the listening socket and waits for the responses a little longer (its graceful
timeout), then cancels whatever is still writing (a stalled client); the lifespan joins the engine
thread. A watchdog armed at the signal ends the process if it is somehow still alive well after that
bound, so neither a stalled client nor a hung engine step can keep it up.

Engine failure: `/healthz` already answers 503; the server keeps answering for `FAILURE_LINGER` seconds
(so health probes see the 503), then shuts down with a short grace, and the command exits non-zero.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from deterministic_inference.engine.async_engine import AsyncEngine, EngineState

FAILURE_LINGER = 1.0  # seconds /healthz keeps answering 503 after the engine died, before the exit
FAILURE_GRACE = 2  # seconds in-flight responses get to finish after the engine died
RESPONSE_GRACE = 1  # seconds uvicorn waits beyond the engine's deadline for aborted responses to go out
WATCHDOG_MARGIN = 15.0  # a shutdown still running this long after its bound ends the process
LOAD_POLL = 0.02  # seconds between looks at the engine thread while it builds the engine

logger = logging.getLogger("detinf.server")


class BoundedServer(uvicorn.Server):
    """A uvicorn Server whose shutdown is bounded (see the module docstring)."""

    def __init__(
        self,
        config: uvicorn.Config,
        shutdown_timeout: float,
        on_exit_signal: Callable[[], None] | None,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self.on_exit_signal = on_exit_signal  # must be signal-safe (e.g. call_soon_threadsafe)
        self.on_started = on_started  # called once the port is bound and the app accepts requests

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.on_started is not None:
            self.on_started()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            logger.info("signal %d: shutting down; in-flight requests get %.1f s", sig, self.shutdown_timeout)
            arm_watchdog(self.shutdown_timeout + RESPONSE_GRACE + WATCHDOG_MARGIN)
            if self.on_exit_signal is not None:
                self.on_exit_signal()
        super().handle_exit(sig, frame)

    def exit_after_failure(self) -> None:
        """The engine died: keep answering (503) for FAILURE_LINGER seconds, then shut down with a short
        grace. Call from the event loop."""

        def begin() -> None:
            current = self.config.timeout_graceful_shutdown
            self.config.timeout_graceful_shutdown = min(current, FAILURE_GRACE) if current else FAILURE_GRACE
            self.should_exit = True

        arm_watchdog(FAILURE_LINGER + FAILURE_GRACE + WATCHDOG_MARGIN)
        asyncio.get_running_loop().call_later(FAILURE_LINGER, begin)


def make_server(
    app: Any,
    host: str,
    port: int,
    log_level: str,
    shutdown_timeout: float,
    on_exit_signal: Callable[[], None] | None = None,
    on_started: Callable[[], None] | None = None,
) -> BoundedServer:
    """The server for `app`; uvicorn's graceful timeout is the shutdown timeout (whole seconds) plus
    RESPONSE_GRACE. `on_started` runs once the port is bound."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=math.ceil(shutdown_timeout) + RESPONSE_GRACE,
    )
    return BoundedServer(config, shutdown_timeout, on_exit_signal, on_started)


def serve_when_engine_ready(server: BoundedServer, engine: AsyncEngine) -> str | None:
    """Build the engine in its thread, then bind the port and serve until shutdown (see the module
    docstring). Returns the one-line reason when the engine failed to start (nothing was bound), else
    None: after serving, or after a signal during the build."""
    with asyncio.Runner(loop_factory=server.config.get_loop_factory()) as runner:
        return runner.run(_serve_when_engine_ready(server, engine))


async def _serve_when_engine_ready(server: BoundedServer, engine: AsyncEngine) -> str | None:
    engine.start()  # the app's lifespan sees it started and only stops it at shutdown
    with server.capture_signals():  # SIGTERM/SIGINT while building: server.should_exit
        while engine.state is EngineState.LOADING and not server.should_exit:
            await asyncio.sleep(LOAD_POLL)
    if engine.state is EngineState.FAILED:
        return engine.error or "the engine failed to load"
    if server.should_exit:
        engine.begin_stop(0.0)  # the build cannot be interrupted; the thread ends with the process
        return None
    await server.serve()
    return None


def arm_watchdog(seconds: float) -> None:
    """End the process (exit 1) if it is still running `seconds` from now."""

    def expire() -> None:
        logger.error("shutdown did not finish in %.0f s; exiting", seconds)
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


def configure_logging(level: str) -> None:
    """The package's log lines (engine and server, tracebacks of failures) go to stderr."""
    root = logging.getLogger("detinf")
    if any(getattr(h, "detinf_serve", False) for h in root.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.detinf_serve = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter("%(levelname)s:%(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level.upper())
    root.propagate = False
