"""One engine replica of the replicated server: the unchanged server app (`server/app.py`) with its own
`AsyncEngine`, inside a Ray Serve deployment.

The router (`ingress.py`) forwards each client request as it arrived (`ForwardedRequest`), and the
replica answers it with the app in-process (`asgi_bridge.serve_request`), streaming the head and body
chunks back through a Serve streaming call. So every route, the auth check, validation, error bodies,
SSE streams and the replica's metrics are exactly the one-process server's. `describe()` tells the
router this replica's state and full engine fingerprint (checked when it joins).

Output bits do not depend on being a replica: the engine is the same, built from the same EngineConfig,
and answers the same token ids; only the transport differs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.async_engine import EngineState
from deterministic_inference.fingerprint import hardware_fingerprint
from deterministic_inference.scaleout.asgi_bridge import ForwardedRequest, ResponseHead, serve_request
from deterministic_inference.server.app import ServerSettings, create_app

logger = logging.getLogger("detinf.scaleout")


class EngineReplica:
    """A Serve deployment class holding one server app and its engine (built in the background)."""

    async def __init__(  # type: ignore[misc]  # Ray actors allow an async constructor
        self, index: int, config: EngineConfig, settings: ServerSettings
    ) -> None:
        self.index = index
        self.app = create_app(config, settings)
        self._lifespan = contextlib.AsyncExitStack()
        # Starts the engine thread (model load + self-check run there; /healthz says loading meanwhile).
        await self._lifespan.enter_async_context(self.app.router.lifespan_context(self.app))
        self._fingerprint: dict[str, Any] | None = None
        self._hardware = hardware_fingerprint()

    async def describe(self) -> dict[str, Any]:
        """State, system_fingerprint and full engine fingerprint of this replica (for the router)."""
        engine = self.app.state.ctx.engine
        if engine.ready and self._fingerprint is None:
            self._fingerprint = await engine.call(lambda built: built.fingerprint)
        info = engine.info
        return {
            "index": self.index,
            "state": engine.state.value,
            "system_fingerprint": info.system_fingerprint if info is not None else None,
            "fingerprint": self._fingerprint,
            "hardware": self._hardware,
            "error": engine.public_error,
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }

    async def handle(self, request: ForwardedRequest) -> AsyncIterator[ResponseHead | bytes]:
        """The app's response to a forwarded request: the head, then body chunks (a streaming call)."""
        async for item in serve_request(self.app, request):
            yield item

    async def check_health(self) -> None:
        """Serve's health check: a replica whose engine died is restarted by Serve."""
        if self.app.state.ctx.engine.state is EngineState.FAILED:
            raise RuntimeError(f"replica {self.index}: the engine failed")

    async def __del__(self) -> None:
        """Stop the engine (Serve gives the replica graceful_shutdown_timeout_s first)."""
        with contextlib.suppress(Exception):
            await self._lifespan.aclose()
