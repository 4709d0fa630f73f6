"""What a request submitted to the `AsyncEngine` gets back: its stream of deltas, and the errors.

`Sink` is the request's asyncio queue, fed from the engine thread; `RequestStream` reads it on the
event loop, merging deltas that queued up while the consumer was busy (concatenation: nothing is lost).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from deterministic_inference.engine.outputs import OutputAssembler, RequestDelta, RequestOutput, merge_deltas
from deterministic_inference.errors import DetinfError, EngineDeadError


class QueueFullError(DetinfError):
    """The bounded request queue is full; retry later (HTTP 429 with Retry-After)."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineNotReadyError(DetinfError):
    """The engine is still loading, failed to load, or is shutting down (HTTP 503)."""


class ShutdownAbortError(EngineNotReadyError):
    """The server shut down before the request finished (HTTP 503)."""


class RequestFailedError(DetinfError):
    """This request failed inside the engine; other requests were not affected (HTTP 500)."""


class Sink:
    """One request's asyncio queue, fed from the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, item: Any) -> None:
        """Thread-safe: schedule `item` onto the queue in the event loop (no-op once the loop closed)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # loop closed: nobody is listening any more
            pass


def fold(assembler: OutputAssembler | None, delta: RequestDelta) -> OutputAssembler:
    """Start assembling at the first delta, then add each next one."""
    if assembler is None:
        return OutputAssembler(delta)
    assembler.add(delta)
    return assembler


class RequestStream:
    """A request accepted by the engine: iterate `deltas()` (or await `result()`), then `close()`."""

    def __init__(self, request_id: str, sink: Sink, on_close: Callable[[bool], None]) -> None:
        self.request_id = request_id
        self._sink = sink
        self._on_close = on_close  # called once with `finished`: aborts an unfinished request
        self._held: Any = None  # an item taken from the queue while merging, served next
        self.finished = False
        self._closed = False

    async def deltas(self) -> AsyncIterator[RequestDelta]:
        """The request's deltas until it finished (the last one has `finished`). Deltas that queued up
        while the consumer was busy are merged into one (concatenation: nothing is lost or changed).
        Raises RequestFailedError if the request failed in the engine, EngineDeadError if the engine
        died, ShutdownAbortError if the server shut down first."""
        while not self.finished:
            item = await self._next()
            if isinstance(item, RequestDelta):
                item = self._merge_queued(item)
            if isinstance(item, BaseException):
                self.finished = True
                self.close()
                raise item
            if item.error is not None:
                self.finished = True
                self.close()
                raise RequestFailedError(item.error)
            if item.finished:
                self.finished = True
                self.close()
            yield item

    async def result(self) -> RequestOutput:
        """The finished output, assembled from the deltas (waits for them)."""
        assembler: OutputAssembler | None = None
        async for delta in self.deltas():
            assembler = fold(assembler, delta)
        if assembler is None:  # pragma: no cover - deltas() always ends with a finished delta or raises
            raise EngineDeadError("request ended without output")
        return assembler.output()

    async def _next(self) -> Any:
        if self._held is not None:
            item, self._held = self._held, None
            return item
        return await self._sink.queue.get()

    def _merge_queued(self, delta: RequestDelta) -> RequestDelta:
        while not delta.finished and delta.error is None:
            try:
                item = self._sink.queue.get_nowait()
            except asyncio.QueueEmpty:
                break
            if not isinstance(item, RequestDelta):
                self._held = item
                break
            delta = merge_deltas(delta, item)
        return delta

    def close(self) -> None:
        """Release the request's admission slot; abort it in the engine if it has not finished."""
        if self._closed:
            return
        self._closed = True
        self._on_close(self.finished)
