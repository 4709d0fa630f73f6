"""What every endpoint shares: engine access, model-name check, prompt preparation, submission,
consuming the engine's deltas, disconnect handling.

Admission: prompts are tokenized (chat templates rendered) here, on the event loop or, for long text,
in a worker thread, and every prompt of a request is checked against the engine's limits before any
of them is submitted: request content that cannot run is a 400 naming the field, and the engine thread
only ever sees token ids that fit.

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
    RequestStream,
    encode_text,
    fold,
)
from deterministic_inference.engine.outputs import OutputAssembler, RequestDelta, RequestOutput
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.errors import EngineDeadError, InvalidRequestError
from deterministic_inference.server.errors import APIError
from deterministic_inference.server.metrics import ServerMetrics

T = TypeVar("T")
INLINE_TEXT_CHARS = 8192  # longer text is tokenized / rendered in a worker thread, off the event loop


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


@dataclass
class ServingContext:
    """Shared state of one app: the async engine, metrics and the served model name."""

    engine: AsyncEngine
    metrics: ServerMetrics
    served_model_name: str | None  # None = the loaded model's own name

    def info(self) -> EngineInfo:
        """Facts about the ready engine; 503 while loading, shutting down or after it died."""
        return self.engine.check_ready()

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
            shown = requested if len(requested) <= 100 else requested[:100] + "..."
            raise APIError(
                404,
                f"model {shown!r} does not exist; this server serves {name!r}",
                param="model",
                code="model_not_found",
            )
        return name

    async def encode(self, text: str, param: str) -> list[int]:
        """Token ids of request text (400 naming `param` if the tokenizer refuses it)."""
        tokenizer = self.info().tokenizer
        if len(text) > INLINE_TEXT_CHARS:
            return await asyncio.to_thread(encode_text, tokenizer, text, param)
        return encode_text(tokenizer, text, param)

    async def render_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of a conversation (and its tools, for templates that render them) through the
        model's chat template (400 on `messages` if the template or the tokenizer refuses it)."""
        tokenizer = self.info().tokenizer
        size = sum(len(str(m.get("content", ""))) for m in messages)

        def render() -> list[int]:
            try:
                text = tokenizer.apply_chat_template(messages, tools=tools)
            except InvalidRequestError:
                raise
            except Exception as error:  # noqa: BLE001 - request content: a 400
                raise InvalidRequestError(
                    f"messages: the chat template cannot render them ({type(error).__name__})",
                    param="messages",
                ) from None
            return encode_text(tokenizer, text, "messages")

        if size > INLINE_TEXT_CHARS or len(messages) > 64:
            return await asyncio.to_thread(render)
        return render()

    def check_capacity(self, num_prompts: int, n: int, prompt_param: str = "prompt") -> None:
        """400 when a request holds more sequences (prompts x n) than the server can ever admit; call
        before tokenizing its prompts."""
        capacity = self.engine.capacity
        if n > capacity:
            raise InvalidRequestError(f"n: {n} exceeds the server's capacity of {capacity}", param="n")
        if num_prompts * n > capacity:
            raise InvalidRequestError(
                f"{prompt_param}: {num_prompts} prompts x n={n} sequences exceed the server's capacity of "
                f"{capacity}; send fewer at once",
                param=prompt_param,
            )

    async def submit(
        self,
        prompts: Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams],
        prefix: str,
        prompt_param: str = "prompt",
        max_tokens_param: str = "max_tokens",
    ) -> list[Tracked]:
        """Check every prompt, then submit one engine request per prompt (`params`: shared, or one per
        prompt); all accepted or none (the others are aborted)."""
        info = self.info()
        each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        counts = sorted({p.n for p in each})
        if len(counts) <= 1:
            self.check_capacity(len(prompts), counts[0] if counts else 1, prompt_param)
        elif sum(p.n for p in each) > self.engine.capacity:
            raise InvalidRequestError(
                f"{prompt_param}: {sum(p.n for p in each)} sequences exceed the server's capacity of "
                f"{self.engine.capacity}; send fewer at once",
                param=prompt_param,
            )
        pairs = zip(prompts, each, strict=True)
        checked = [info.limits.check(ids, p, prompt_param, max_tokens_param) for ids, p in pairs]
        tracked: list[Tracked] = []
        try:
            for ids, p in zip(checked, each, strict=True):
                request_id = self.engine.new_request_id(prefix)
                stream = await self.engine.add(ids, p, request_id)
                tracked.append(Tracked(stream, self.metrics, time.monotonic()))
        except BaseException:
            for item in tracked:
                item.close()
            raise
        return tracked


class Tracked:
    """A request stream plus its timing metrics; assembles the full output from the deltas it passes on."""

    def __init__(self, stream: RequestStream, metrics: ServerMetrics, start: float) -> None:
        self.stream = stream
        self.metrics = metrics
        self.start = start
        self._first_token_seen = False
        self.assembler: OutputAssembler | None = None  # the request so far (set from the first delta)
        self.final: RequestOutput | None = None

    async def deltas(self) -> AsyncIterator[RequestDelta]:
        """The stream's deltas (coalesced), folded into `assembler`, recording metrics on the way."""
        async for delta in self.stream.deltas():
            self.assembler = assembler = fold(self.assembler, delta)
            if not self._first_token_seen and any(piece.token_ids for piece in delta.outputs):
                self._first_token_seen = True
                self.metrics.observe_first_token(time.monotonic() - self.start)
            if delta.finished:
                self.final = assembler.output()
                self.metrics.observe_finished(
                    len(assembler.prompt.token_ids), assembler.num_generated, time.monotonic() - self.start,
                    [choice.finish_reason for choice in self.final.outputs],
                )
            yield delta

    async def result(self) -> RequestOutput:
        """Wait for the finished output."""
        async for _ in self.deltas():
            pass
        if self.final is None:  # pragma: no cover - deltas() ends with a finished delta or raises
            raise EngineDeadError("request ended without a final output")
        return self.final

    def close(self) -> None:
        """Abort if unfinished (counted as aborted) and release the admission slot."""
        if not self.stream.finished and self.final is None:
            self.metrics.count_aborted()
        self.stream.close()


async def results(tracked: Sequence[Tracked]) -> list[RequestOutput]:
    """Finished outputs of all requests, in order."""
    return list(await asyncio.gather(*(item.result() for item in tracked)))


async def merged(tracked: Sequence[Tracked]) -> AsyncIterator[tuple[int, RequestDelta]]:
    """(request index, delta) from several streams as they arrive, until all finished."""
    if len(tracked) == 1:
        async for delta in tracked[0].deltas():
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, RequestDelta | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, item: Tracked) -> None:
        try:
            async for delta in item.deltas():
                queue.put_nowait((index, delta))
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
