"""`AsyncEngine`: the engine in one background thread, driven from an asyncio event loop.

Only the engine thread touches the `Engine` (scheduler, KV cache, model). The event loop talks to it
through a thread-safe command queue (add, abort, call, stop), and the thread hands each request's
outputs back through that request's asyncio queue with `loop.call_soon_threadsafe`, so the event loop
never blocks on compute. The engine is also *built* in that thread: the server can answer `/healthz`
(503) while the model loads and the start-up self-check runs.

The order in which the thread applies commands is the order the event loop submitted them, and the
engine's outputs do not depend on timing (the determinism contract), so running it in a thread changes
when results arrive, never what they are.

Failure handling: if the engine raises while stepping, every in-flight request receives
`EngineDeadError` and later submissions fail at once with it: a request never hangs on a dead engine.
"""

from __future__ import annotations

import asyncio
import enum
import queue
import threading
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.outputs import RequestOutput
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.errors import DetinfError, EngineDeadError, InvalidRequestError
from deterministic_inference.model.tokenizer import Tokenizer

T = TypeVar("T")


class QueueFullError(DetinfError):
    """The bounded request queue is full; retry later (HTTP 429 with Retry-After)."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineNotReadyError(DetinfError):
    """The engine is still loading, failed to load, or is shutting down (HTTP 503)."""


class EngineState(enum.Enum):
    """Life cycle of the engine thread."""

    NEW = "new"  # start() not called yet
    LOADING = "loading"  # building the engine (model load, self-check)
    READY = "ready"  # serving
    STOPPING = "stopping"  # no new requests; finishing in-flight ones
    STOPPED = "stopped"  # thread exited normally
    FAILED = "failed"  # failed to load, or died while serving


@dataclass(frozen=True)
class EngineInfo:
    """Read-only facts about the loaded engine, published once by the engine thread."""

    system_fingerprint: str
    model_name: str
    max_model_len: int
    tokenizer: Tokenizer  # read-only use from the event loop (chat template, token texts)
    max_num_seqs: int


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    sink: _Sink


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[Engine], Any]
    sink: _Sink


class _Stop:
    pass


_Command = _Add | _Abort | _Call | _Stop
_ACCEPTED = object()  # first item of a request's queue once the engine took it


class _Sink:
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


class AsyncEngine:
    """Owns an `Engine` in one background thread; asyncio API for the server.

    `capacity` bounds the sequences (sum of `n` over requests) admitted and not yet finished; past it
    `add` raises `QueueFullError`. Call `start()` from the event loop, `await stop()` to drain.
    """

    def __init__(self, engine_factory: Callable[[], Engine], capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._factory = engine_factory
        self.capacity = capacity
        self.state = EngineState.NEW
        self.error: str | None = None  # why the engine failed, when it did
        self.info: EngineInfo | None = None
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards state changes against submissions
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._stats: dict[str, Any] = {}
        self._inflight = 0  # sequences admitted and not finished (event-loop side only)
        self._next_id = 0
        self.on_load_failure: Callable[[str], None] | None = None  # called in the loop thread
        self.on_ready: Callable[[EngineInfo], None] | None = None  # called in the loop thread

    # ----- event-loop side -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (builds the engine); call from the running event loop."""
        if self.state is not EngineState.NEW:
            raise RuntimeError("AsyncEngine.start() called twice")
        self._loop = asyncio.get_running_loop()
        self.state = EngineState.LOADING
        self._thread = threading.Thread(target=self._thread_main, name="detinf-engine", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        """True while the engine serves requests."""
        return self.state is EngineState.READY

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until the engine is built; raises EngineNotReadyError if it failed or timed out."""
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        while not self._ready.is_set():
            if deadline is not None and asyncio.get_running_loop().time() > deadline:
                raise EngineNotReadyError(f"engine not ready after {timeout} s")
            await asyncio.sleep(0.02)
        if self.state is not EngineState.READY:
            raise EngineNotReadyError(f"engine failed to start: {self.error}")

    def stats(self) -> dict[str, Any]:
        """Last engine counters published by the engine thread, plus the admitted sequences."""
        snapshot = dict(self._stats)
        snapshot["num_inflight_sequences"] = self._inflight
        return snapshot

    def new_request_id(self, prefix: str) -> str:
        """A fresh request id `<prefix>-<counter>` (unique within this engine)."""
        self._next_id += 1
        return f"{prefix}-{self._next_id}"

    async def add(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestStream:
        """Submit a request and wait until the engine accepted it (prompt encoded and validated).

        Raises QueueFullError, EngineNotReadyError, EngineDeadError, or InvalidRequestError from the
        engine (too long for the context, bad token ids...). Close the returned stream when done.
        """
        if params.n > self.capacity:
            raise InvalidRequestError(f"n: {params.n} exceeds the server's capacity of {self.capacity}", "n")
        if self._inflight + params.n > self.capacity:
            raise QueueFullError(f"server busy: {self._inflight} sequences in flight; retry shortly")
        loop = asyncio.get_running_loop()
        request_id = request_id or self.new_request_id("req")
        sink = _Sink(loop)
        self._submit(_Add(request_id, prompt if isinstance(prompt, str) else list(prompt), params, sink))
        self._inflight += params.n
        stream = RequestStream(self, request_id, params.n, sink)
        try:
            first = await sink.queue.get()
        except BaseException:
            stream.close()
            raise
        if first is not _ACCEPTED:
            stream.close()
            raise first
        return stream

    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield every output until it finished; cancelling aborts it."""
        stream = await self.add(prompt, params, request_id)
        try:
            async for output in stream.outputs(coalesce=False):
                yield output
        finally:
            stream.close()

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` in the engine thread between steps; returns its result."""
        sink = _Sink(asyncio.get_running_loop())
        self._submit(_Call(fn, sink))
        ok, value = await sink.queue.get()
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    async def stop(self) -> None:
        """Stop accepting requests, let in-flight ones finish, and join the engine thread."""
        with self._lock:
            if self.state in (EngineState.LOADING, EngineState.READY):
                self.state = EngineState.STOPPING
                self._commands.put(_Stop())
            thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join)

    def _submit(self, command: _Command) -> None:
        with self._lock:
            if self.state is EngineState.FAILED:
                raise EngineDeadError(f"the engine is not running: {self.error}")
            if self.state is not EngineState.READY:
                raise EngineNotReadyError(f"the engine is {self.state.value}; retry later")
            self._commands.put(command)

    def _abort(self, request_id: str) -> None:
        with self._lock:
            if self.state in (EngineState.READY, EngineState.STOPPING):
                self._commands.put(_Abort(request_id))

    def _finished(self, num_sequences: int) -> None:
        self._inflight -= num_sequences

    # ----- engine-thread side --------------------------------------------------------------------

    def _thread_main(self) -> None:
        try:
            engine = self._factory()
        except BaseException as error:  # noqa: BLE001 - any load failure must be reported, not raised
            self._die(error, loading=True)
            return
        self.info = EngineInfo(
            system_fingerprint=engine.system_fingerprint,
            model_name=engine.loaded.name,
            max_model_len=engine.max_model_len,
            tokenizer=engine.tokenizer,
            max_num_seqs=engine.config.max_num_seqs,
        )
        self._stats = engine.stats()
        with self._lock:
            stopped_while_loading = self.state is not EngineState.LOADING
            self.state = EngineState.STOPPED if stopped_while_loading else EngineState.READY
        self._ready.set()
        if stopped_while_loading:
            return
        self._notify(self.on_ready, self.info)
        sinks: dict[str, _Sink] = {}
        try:
            self._serve(engine, sinks)
        except BaseException as error:  # noqa: BLE001 - fail every request instead of hanging them
            self._die(error, loading=False, sinks=sinks)
            return
        with self._lock:
            self.state = EngineState.STOPPED

    def _serve(self, engine: Engine, sinks: dict[str, _Sink]) -> None:
        stopping = False
        while True:
            commands = self._take_commands(block=not engine.has_unfinished and not stopping)
            for command in commands:
                if isinstance(command, _Stop):
                    stopping = True
                else:
                    self._apply(engine, command, sinks)
            outputs = engine.step() if engine.has_unfinished else None
            if commands or outputs is not None:
                self._stats = engine.stats()  # published before the outputs: clients never see stale stats
            if outputs:
                self._deliver(engine, outputs, sinks)
            if stopping and not engine.has_unfinished:
                return

    def _take_commands(self, block: bool) -> list[_Command]:
        commands: list[_Command] = []
        if block:
            commands.append(self._commands.get())
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, engine: Engine, command: _Command, sinks: dict[str, _Sink]) -> None:
        if isinstance(command, _Add):
            try:
                engine.add_request(command.prompt, command.params, command.request_id)
            except DetinfError as error:
                command.sink.put(error)
                return
            sinks[command.request_id] = command.sink
            command.sink.put(_ACCEPTED)
        elif isinstance(command, _Abort):
            engine.abort(command.request_id)
            sinks.pop(command.request_id, None)
        elif isinstance(command, _Call):
            try:
                command.sink.put((True, command.fn(engine)))
            except DetinfError as error:
                command.sink.put((False, error))

    def _deliver(self, engine: Engine, outputs: list[RequestOutput], sinks: dict[str, _Sink]) -> None:
        for output in outputs:
            sink = sinks.get(output.request_id)
            if sink is None:
                continue
            sink.put(output)
            if output.finished:
                del sinks[output.request_id]
                engine.release(output.request_id)

    def _die(self, error: BaseException, loading: bool, sinks: dict[str, _Sink] | None = None) -> None:
        summary = f"{type(error).__name__}: {error}"
        if not isinstance(error, DetinfError):
            summary += "\n" + "".join(traceback.format_exception(error)[-3:])
        with self._lock:
            self.state = EngineState.FAILED
            self.error = summary
            pending = self._take_commands(block=False)
        self._ready.set()
        dead = EngineDeadError(f"the engine stopped: {summary.splitlines()[0]}")
        for sink in (sinks or {}).values():
            sink.put(dead)
        for command in pending:
            if isinstance(command, _Add):
                command.sink.put(dead)
            elif isinstance(command, _Call):
                command.sink.put((False, dead))
        if loading:
            self._notify(self.on_load_failure, summary)

    def _notify(self, callback: Callable[[Any], None] | None, argument: Any) -> None:
        if callback is not None and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(callback, argument)
            except RuntimeError:  # loop closed
                pass


class RequestStream:
    """A request accepted by the engine: iterate `outputs()`, then `close()` (aborts if unfinished)."""

    def __init__(self, engine: AsyncEngine, request_id: str, num_sequences: int, sink: _Sink) -> None:
        self.request_id = request_id
        self._engine = engine
        self._num_sequences = num_sequences
        self._sink = sink
        self.finished = False
        self._closed = False

    async def outputs(self, coalesce: bool = True) -> AsyncIterator[RequestOutput]:
        """Outputs until the request finished (the last one has `finished`). With `coalesce`, outputs
        that queued up while the consumer was busy are skipped in favour of the newest one: each output
        is a full snapshot, so nothing is lost. Raises EngineDeadError if the engine died."""
        while not self.finished:
            item = await self._sink.queue.get()
            while coalesce and isinstance(item, RequestOutput) and not item.finished:
                try:
                    item = self._sink.queue.get_nowait()
                except asyncio.QueueEmpty:
                    break
            if isinstance(item, BaseException):
                self.close()
                raise item
            if item.finished:
                self.finished = True
                self.close()
            yield item

    async def result(self) -> RequestOutput:
        """The finished output (waits for it)."""
        last: RequestOutput | None = None
        async for output in self.outputs():
            last = output
        if last is None:  # pragma: no cover - outputs() always ends with a finished output
            raise EngineDeadError("request ended without output")
        return last

    def close(self) -> None:
        """Release the request's admission slot; abort it in the engine if it has not finished."""
        if self._closed:
            return
        self._closed = True
        if not self.finished:
            self._engine._abort(self.request_id)
        self._engine._finished(self._num_sequences)
