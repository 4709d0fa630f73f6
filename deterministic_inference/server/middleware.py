"""ASGI middleware: Bearer-token auth (constant-time) and per-path request counting.

A plain ASGI middleware (not BaseHTTPMiddleware) so streaming responses and client disconnects pass
through untouched.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from deterministic_inference.server.errors import APIError
from deterministic_inference.server.metrics import ServerMetrics

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/healthz"})  # reachable without the API key
KNOWN_PATHS = frozenset(
    {
        "/healthz",
        "/metrics",
        "/flush_cache",
        "/generate",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/openapi.json",
        "/docs",
    }
)


def bearer_matches(header_value: bytes | None, api_key: str) -> bool:
    """True when the Authorization header is `Bearer <api_key>` (constant-time comparison)."""
    if header_value is None:
        return False
    scheme, _, token = header_value.decode("latin-1").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), api_key.encode())


class AuthMetricsMiddleware:
    """Rejects unauthenticated requests with 401 (when an API key is set) and counts every response."""

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: ServerMetrics) -> None:
        self.app = app
        self.api_key = api_key
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        label = path if path in KNOWN_PATHS else "other"
        if self.api_key and path not in OPEN_PATHS:
            headers = dict(scope.get("headers") or [])
            if not bearer_matches(headers.get(b"authorization"), self.api_key):
                error = APIError(
                    401,
                    "invalid or missing API key: send 'Authorization: Bearer <key>'",
                    "authentication_error",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error.response()(scope, receive, send)
                self.metrics.count_request(label, 401)
                return
        status = 500

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.count_request(label, status)
