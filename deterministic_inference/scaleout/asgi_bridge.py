"""Run one forwarded HTTP request through an ASGI app in-process (plain Python; no Ray).

A replica holds the unchanged server app (`server/app.py`) and answers forwarded requests with it, so
routes, auth, validation, error bodies, SSE streaming and metrics are the single-process server's own.
`serve_request` yields the response head first, then the body chunks as the app sends them (an SSE
stream stays a stream). Closing the generator early (the client went away) makes the app's `receive`
return `http.disconnect`, which aborts the request in the engine as in the one-process server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]
DRAIN_TIMEOUT = 5.0  # seconds the app gets to finish after a disconnect before its task is cancelled


@dataclass(frozen=True)
class ForwardedRequest:
    """What the router passes to a replica: the client's request as it arrived."""

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]  # raw (lower-case name, value) pairs
    body: bytes
    client: tuple[str, int] | None = None

    def scope(self) -> dict[str, Any]:
        """The ASGI HTTP scope of this request."""
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": self.method,
            "scheme": "http",
            "path": self.path,
            "raw_path": self.path.encode("latin-1", "replace"),
            "root_path": "",
            "query_string": self.query_string,
            "headers": [list(pair) for pair in self.headers],
            "client": self.client,
            "server": ("127.0.0.1", 0),
            "state": {},
        }


@dataclass(frozen=True)
class ResponseHead:
    """Status and raw headers of a response."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]


async def serve_request(app: ASGIApp, request: ForwardedRequest) -> AsyncIterator[ResponseHead | bytes]:
    """The app's response to `request`: one ResponseHead, then body chunks (non-empty bytes)."""
    outbox: asyncio.Queue[Message | BaseException] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if disconnected.is_set():
            raise OSError("client disconnected")
        outbox.put_nowait(message)

    async def run() -> None:
        try:
            await app(request.scope(), receive, send)
        except BaseException as error:  # forwarded to the reader below
            outbox.put_nowait(error)
            raise
        outbox.put_nowait({"type": "detinf.app_done"})

    task = asyncio.create_task(run())
    try:
        while True:
            item = await outbox.get()
            if isinstance(item, BaseException):
                raise item
            kind = item["type"]
            if kind == "http.response.start":
                headers = tuple((bytes(k), bytes(v)) for k, v in item.get("headers", []))
                yield ResponseHead(int(item["status"]), headers)
            elif kind == "http.response.body":
                chunk = bytes(item.get("body", b""))
                if chunk:
                    yield chunk
                if not item.get("more_body", False):
                    return
            elif kind == "detinf.app_done":
                return
    finally:
        disconnected.set()
        await _drain(task)


async def _drain(task: asyncio.Task[None]) -> None:
    """Let the app finish after the response (or a disconnect), bounded by DRAIN_TIMEOUT."""
    with contextlib.suppress(BaseException):
        await asyncio.wait_for(asyncio.shield(task), DRAIN_TIMEOUT)
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
