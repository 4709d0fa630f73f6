"""`AsyncEngine`: the engine in one background thread, driven from an asyncio event loop.

Only the engine thread touches the `Engine` (scheduler, KV cache, model); its loop is `EngineLoop`. The
event loop talks to it through a thread-safe command queue (add, abort, call, stop), and the thread hands
each request's per-step deltas back through that request's asyncio queue with
`loop.call_soon_threadsafe`, so the event loop never blocks on compute. The engine is also *built* in that
thread: the server can answer `/healthz` (503) while the model loads and the start-up self-check runs.

The order in which the thread applies commands is the order the event loop submitted them, and the
engine's outputs do not depend on timing (the determinism contract), so running it in a thread changes
when results arrive, never what they are.

Admission: `add` takes token ids (or text, tokenized here, on the caller's side) and checks them against
the engine's limits BEFORE submitting, so request content never fails inside the engine thread.

Failures: a request that fails inside a step (its own sampling or detokenization) gets
`RequestFailedError`, the others go on. If a step itself raises (an engine bug), every in-flight request
receives `EngineDeadError`, later submissions fail at once with it, the traceback goes to the log only,
and `on_failure` is called so the server can exit for its supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from deterministic_inference.engine.admission import AdmissionLimits
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.engine_loop import (
    ACCEPTED,
    AbortCommand,
    AddCommand,
    CallCommand,
    Command,
    EngineLoop,
    StopCommand,
)
from deterministic_inference.engine.grammar import GrammarCompiler
from deterministic_inference.engine.outputs import OutputAssembler, RequestOutput
from deterministic_inference.engine.request_stream import (
    EngineNotReadyError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
    ShutdownAbortError,
    Sink,
    fold,
)
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.errors import EngineDeadError, InvalidRequestError
from deterministic_inference.model.tokenizer import Tokenizer

__all__ = [
    "AsyncEngine",
    "EngineInfo",
    "EngineNotReadyError",
    "EngineState",
    "QueueFullError",
    "RequestFailedError",
    "RequestStream",
    "ShutdownAbortError",
    "encode_text",
    "fold",
]

T = TypeVar("T")
logger = logging.getLogger("detinf.engine")
STOP_JOIN_GRACE = 5.0  # seconds a stop waits for the engine thread beyond its drain deadline


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
    tokenizer: Tokenizer  # read-only use from the event loop (tokenize, chat template, token texts)
    max_num_seqs: int
    limits: AdmissionLimits  # what a request must satisfy before it is submitted
    # compiles structured-output constraints (thread-safe, cached): call it off the event loop, e.g.
    # `await asyncio.to_thread(info.grammars.compile, spec)`, before submitting a constrained request
    grammars: GrammarCompiler


def encode_text(tokenizer: Tokenizer, text: str, param: str = "prompt") -> list[int]:
    """Token ids of request text; InvalidRequestError (naming `param`) if the tokenizer refuses it."""
    try:
        return tokenizer.encode(text)
    except Exception as error:  # noqa: BLE001 - request content: a 400, never an engine failure
        raise InvalidRequestError(
            f"{param}: the text cannot be tokenized ({type(error).__name__}); send valid Unicode text",
            param=param,
        ) from None


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
        self.error: str | None = None  # why the engine failed, one line (for the log and the operator)
        self.public_error: str | None = None  # the same for clients: no message text, no path
        self.info: EngineInfo | None = None
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards state changes against submissions
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._serving = False  # the engine thread is in its serving loop
        self._stats: dict[str, Any] = {}
        self._inflight = 0  # sequences admitted and not finished (event-loop side only)
        self._next_id = 0
        self.on_load_failure: Callable[[str], None] | None = None  # called in the loop thread
        self.on_ready: Callable[[EngineInfo], None] | None = None  # called in the loop thread
        self.on_failure: Callable[[str], None] | None = None  # engine died while serving (loop thread)

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

    def check_ready(self) -> EngineInfo:
        """The engine's info; EngineDeadError if it failed, EngineNotReadyError if not serving."""
        if self.state is EngineState.FAILED:
            raise EngineDeadError(self.public_error or "the engine is not running")
        if self.state is not EngineState.READY or self.info is None:
            raise EngineNotReadyError(f"the engine is {self.state.value}; retry when /healthz returns 200")
        return self.info

    async def add(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestStream:
        """Check and submit a request, then wait until the engine accepted it.

        Text is tokenized here, and the ids are checked against the engine's limits (vocabulary,
        context, KV pool) before anything reaches the engine thread. Raises InvalidRequestError,
        QueueFullError, EngineNotReadyError or EngineDeadError. Close the returned stream when done.
        """
        info = self.check_ready()
        ids = encode_text(info.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
        ids = info.limits.check(ids, params)
        if params.n > self.capacity:
            raise InvalidRequestError(f"n: {params.n} exceeds the server's capacity of {self.capacity}", "n")
        if self._inflight + params.n > self.capacity:
            raise QueueFullError(f"server busy: {self._inflight} sequences in flight; retry shortly")
        request_id = request_id or self.new_request_id("req")
        sink = Sink(asyncio.get_running_loop())
        self._submit(AddCommand(request_id, ids, params, sink))
        self._inflight += params.n
        stream = RequestStream(request_id, sink, on_close=self._closed_stream(request_id, params.n))
        try:
            first = await sink.queue.get()
        except BaseException:
            stream.close()
            raise
        if first is not ACCEPTED:
            stream.close()
            raise first
        return stream

    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its full output after every delta until it finished (assembled
        from the deltas); cancelling aborts it."""
        stream = await self.add(prompt, params, request_id)
        assembler: OutputAssembler | None = None
        try:
            async for delta in stream.deltas():
                assembler = fold(assembler, delta)
                yield assembler.output()
        finally:
            stream.close()

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` in the engine thread between steps; returns its result."""
        sink = Sink(asyncio.get_running_loop())
        self._submit(CallCommand(fn, sink))
        ok, value = await sink.queue.get()
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    async def update_weights(self, weights: Mapping[str, torch.Tensor], param: str = "weights") -> EngineInfo:
        """`Engine.update_weights` in the engine thread between steps (its errors raised here; the old
        weights keep serving), then the new fingerprint is published in `info`. It refuses while
        requests are in flight: the server lets them finish first (server/weights_route.py)."""
        fingerprint = await self.call(lambda engine: engine.update_weights(weights, param))
        self.info = dataclasses.replace(self.check_ready(), system_fingerprint=fingerprint)
        return self.info

    def begin_stop(self, timeout: float | None = None) -> None:
        """Stop admitting requests now; in-flight ones may finish for `timeout` seconds (None: until
        done), then the engine thread aborts the rest, freeing their KV blocks (logged)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if self.state in (EngineState.LOADING, EngineState.READY):
                self.state = EngineState.STOPPING
                self._commands.put(StopCommand(deadline))

    def begin_stop_threadsafe(self, timeout: float | None) -> None:
        """`begin_stop` from any thread or a signal handler (runs it on the event loop)."""
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self.begin_stop, timeout)
            except RuntimeError:  # loop closed
                pass

    async def stop(self, timeout: float | None = None) -> bool:
        """`begin_stop(timeout)` (unless a stop already began), then join the engine thread. Returns
        True when the engine stopped cleanly, False when it had failed or a step hung past the bound."""
        self.begin_stop(timeout)
        thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join, None if timeout is None else timeout + STOP_JOIN_GRACE)
            if thread.is_alive() and self._serving:
                logger.error("the engine thread did not stop (a step is hung); exiting without it")
                return False
        return self.state is not EngineState.FAILED

    def _submit(self, command: Command) -> None:
        with self._lock:
            if self.state is EngineState.FAILED:
                raise EngineDeadError(self.public_error or "the engine is not running")
            if self.state is not EngineState.READY:
                raise EngineNotReadyError(f"the engine is {self.state.value}; retry later")
            self._commands.put(command)

    def _closed_stream(self, request_id: str, num_sequences: int) -> Callable[[bool], None]:
        """What closing a request's stream does: abort it in the engine if it has not finished, and
        release its admission slots."""

        def closed(finished: bool) -> None:
            if not finished:
                with self._lock:
                    if self.state in (EngineState.READY, EngineState.STOPPING):
                        self._commands.put(AbortCommand(request_id))
            self._inflight -= num_sequences

        return closed

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
            limits=engine.limits,
            grammars=engine.grammars,
        )
        self._stats = engine.stats()
        with self._lock:
            stopped_while_loading = self.state is not EngineState.LOADING
            self.state = EngineState.STOPPED if stopped_while_loading else EngineState.READY
        self._ready.set()
        if stopped_while_loading:
            return
        self._notify(self.on_ready, self.info)
        loop = EngineLoop(
            engine,
            self._commands,
            self._publish_stats,
            lambda: ShutdownAbortError("the server is shutting down; the request was aborted, retry it"),
            RequestFailedError,
        )
        self._serving = True
        try:
            loop.run()
        except BaseException as error:  # noqa: BLE001 - fail every request instead of hanging them
            self._die(error, loading=False, loop=loop)
            return
        with self._lock:
            self.state = EngineState.STOPPED

    def _publish_stats(self, stats: dict[str, Any]) -> None:
        self._stats = stats

    def _die(self, error: BaseException, loading: bool, loop: EngineLoop | None = None) -> None:
        summary = f"{type(error).__name__}: {error}".splitlines()[0]
        if loading:
            public = f"the engine failed to load ({type(error).__name__}); see the server log"
        else:
            logger.error("the engine failed while serving; failing every in-flight request", exc_info=error)
            name = type(error).__name__
            public = f"the engine stopped after an internal error ({name}); see the server log"
        with self._lock:
            self.state = EngineState.FAILED
            self.error = summary
            self.public_error = public
        self._ready.set()
        dead = EngineDeadError(public)
        pending = loop.take_commands(block=False) if loop is not None else self._drain_commands()
        if loop is not None:
            loop.fail_all(dead)
        for command in pending:
            if isinstance(command, AddCommand):
                command.sink.put(dead)
            elif isinstance(command, CallCommand):
                command.sink.put((False, dead))
        self._notify(self.on_load_failure if loading else self.on_failure, summary)

    def _drain_commands(self) -> list[Command]:
        commands: list[Command] = []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _notify(self, callback: Callable[[Any], None] | None, argument: Any) -> None:
        if callback is not None and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(callback, argument)
            except RuntimeError:  # loop closed
                pass
