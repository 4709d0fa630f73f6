"""What every endpoint shares: engine access, model-name check, submission, disconnect handling.

Disconnects: a non-streaming handler races its work against the client's `http.disconnect`; a
streaming one is cancelled (or fails to write) when the client goes. Either way the request streams
are closed in `finally`, which aborts unfinished requests in the engine and frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request

from deterministic_inference.engine.async_engine import (
    AsyncEngine,
    EngineInfo,
    EngineNotReadyError,
    RequestStream,
)
from deterministic_inference.engine.outputs import RequestOutput
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.errors import EngineDeadError
from deterministic_inference.server.errors import APIError
from deterministic_inference.server.metrics import ServerMetrics

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


@dataclass
class ServingContext:
    """Shared state of one app: the async engine, metrics and the served model name."""

    engine: AsyncEngine
    metrics: ServerMetrics
    served_model_name: str | None  # None = the loaded model's own name

    def info(self) -> EngineInfo:
        """Facts about the ready engine; 503 while loading, 500 if it died."""
        if self.engine.ready and self.engine.info is not None:
            return self.engine.info
        if self.engine.error is not None:
            raise EngineDeadError(f"the engine is not running: {self.engine.error.splitlines()[0]}")
        raise EngineNotReadyError(f"the engine is {self.engine.state.value}; retry when /healthz returns 200")

    @property
    def model_name(self) -> str:
        """The name clients must use in `model`."""
        if self.served_model_name:
            return self.served_model_name
        return self.info().model_name

    def check_model(self, requested: str | None) -> str:
        """The served name; 404 when the request names another model."""
        name = self.model_name
        if requested is not None and requested != name:
            raise APIError(
                404,
                f"model {requested!r} does not exist; this server serves {name!r}",
                param="model",
                code="model_not_found",
            )
        return name

    async def submit(
        self, prompts: Sequence[str | list[int]], params: SamplingParams, prefix: str
    ) -> list[Tracked]:
        """Submit one engine request per prompt; all accepted or none (the others are aborted)."""
        tracked: list[Tracked] = []
        try:
            for prompt in prompts:
                request_id = self.engine.new_request_id(prefix)
                stream = await self.engine.add(prompt, params, request_id)
                tracked.append(Tracked(stream, self.metrics, time.monotonic()))
        except BaseException:
            for item in tracked:
                item.close()
            raise
        return tracked


class Tracked:
    """A request stream plus its timing metrics (time to first token, latency, token counts)."""

    def __init__(self, stream: RequestStream, metrics: ServerMetrics, start: float) -> None:
        self.stream = stream
        self.metrics = metrics
        self.start = start
        self._first_token_seen = False
        self.final: RequestOutput | None = None

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The stream's outputs (coalesced), recording metrics on the way."""
        async for output in self.stream.outputs(coalesce=True):
            if not self._first_token_seen and any(c.token_ids for c in output.outputs):
                self._first_token_seen = True
                self.metrics.time_to_first_token.observe(time.monotonic() - self.start)
            if output.finished:
                self.final = output
                generated = sum(len(c.token_ids) for c in output.outputs)
                self.metrics.observe_finished(
                    len(output.prompt_token_ids), generated, time.monotonic() - self.start
                )
            yield output

    async def result(self) -> RequestOutput:
        """Wait for the finished output."""
        async for _ in self.outputs():
            pass
        if self.final is None:  # pragma: no cover - outputs() ends with a finished output or raises
            raise EngineDeadError("request ended without a final output")
        return self.final

    def close(self) -> None:
        """Abort if unfinished (counted as aborted) and release the admission slot."""
        if not self.stream.finished and self.final is None:
            self.metrics.aborted_requests += 1
        self.stream.close()


async def results(tracked: Sequence[Tracked]) -> list[RequestOutput]:
    """Finished outputs of all requests, in order."""
    return list(await asyncio.gather(*(item.result() for item in tracked)))


async def merged(tracked: Sequence[Tracked]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(request index, output) from several streams as they arrive, until all finished."""
    if len(tracked) == 1:
        async for output in tracked[0].outputs():
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, item: Tracked) -> None:
        try:
            async for output in item.outputs():
                queue.put_nowait((index, output))
            queue.put_nowait((index, None))
        except Exception as error:  # forwarded to the consumer
            queue.put_nowait((index, error))

    tasks = [asyncio.create_task(pump(i, item)) for i, item in enumerate(tracked)]
    try:
        remaining = len(tasks)
        while remaining:
            index, got = await queue.get()
            if got is None:
                remaining -= 1
            elif isinstance(got, BaseException):
                raise got
            else:
                yield index, got
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnected(request: Request) -> None:
    """Returns when the client disconnects (the request body must have been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientGone()
    finally:
        for pending in (task, watcher):
            pending.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(task, watcher, return_exceptions=True)


def close_all(tracked: Sequence[Tracked]) -> None:
    """Close every stream (aborting unfinished requests)."""
    for item in tracked:
        item.close()


def created_now() -> int:
    """OpenAI `created`: seconds since the epoch (metadata only; never part of the compared output)."""
    return int(time.time())


def response_meta(fingerprint: str, object_name: str, response_id: str, model: str) -> dict[str, Any]:
    """Fields every OpenAI response and chunk starts with."""
    return {
        "id": response_id,
        "object": object_name,
        "created": created_now(),
        "model": model,
        "system_fingerprint": fingerprint,
    }
