"""The engine thread's loop: apply commands from the event loop, step, hand each request its deltas.

Runs in the one thread that owns the `Engine`. Commands (add, abort, call, stop) arrive on a thread-safe
queue in the order the event loop submitted them; each request's deltas go back through its own sink.
A stop lets in-flight requests finish until its deadline, then aborts the rest (freeing their KV blocks)
and logs what it did. Anything a request's content could make fail was checked before its add command
(`engine/admission.py`); an add that still fails answers that request alone. An exception from a step is
an engine bug: it propagates to the caller (`AsyncEngine`), which fails every request and reports it.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.outputs import RequestDelta
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.errors import DetinfError

logger = logging.getLogger("detinf.engine")


class Sink(Protocol):
    """Where one request's items go (thread-safe `put`)."""

    def put(self, item: Any) -> None: ...


@dataclass
class AddCommand:
    """Add one request; its sink gets ACCEPTED, then its deltas (or the error that refused it)."""

    request_id: str
    prompt_token_ids: list[int]  # checked against the engine's limits before submission
    params: SamplingParams
    sink: Sink


@dataclass
class AbortCommand:
    """Abort one request (no-op when it already finished); its KV blocks are freed."""

    request_id: str


@dataclass
class CallCommand:
    """Run `fn` on the engine in its own thread, between steps (metrics, weight updates, ...)."""

    fn: Callable[[Engine], Any]
    sink: Sink  # receives (True, result) or (False, error)


@dataclass
class StopCommand:
    """Stop the loop: in-flight requests may finish until the deadline, then the rest are aborted."""

    deadline: float | None  # time.monotonic() after which in-flight requests are aborted; None = wait


Command = AddCommand | AbortCommand | CallCommand | StopCommand
ACCEPTED = object()  # first item of a request's sink once the engine took it


class EngineLoop:
    """Serves commands and steps the engine until stopped (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        commands: queue.SimpleQueue[Command],
        publish_stats: Callable[[dict[str, Any]], None],
        shutdown_error: Callable[[], BaseException],
        request_error: Callable[[str], BaseException],
    ) -> None:
        self.engine = engine
        self.commands = commands
        self.publish_stats = publish_stats
        self.shutdown_error = shutdown_error  # what a request aborted by the shutdown deadline receives
        self.request_error = request_error  # what a request whose add failed unexpectedly receives
        self.sinks: dict[str, Sink] = {}  # in-flight requests
        self.stop: StopCommand | None = None
        self.in_flight_at_stop = 0  # shutdown accounting, logged when the loop ends
        self.finished_while_stopping = 0
        self.aborted_while_stopping = 0

    def run(self) -> None:
        """Until a stop command has been served; raises whatever a step raises."""
        engine = self.engine
        while True:
            commands = self.take_commands(block=not engine.has_unfinished and self.stop is None)
            for command in commands:
                self._apply(command)
            if self._past_deadline():
                self._abort_all()
            deltas = engine.step_deltas() if engine.has_unfinished else None
            if commands or deltas is not None:
                self.publish_stats(engine.stats())  # before the deltas: clients never see stale stats
            if deltas:
                self._deliver(deltas)
            if self.stop is not None and not engine.has_unfinished:
                logger.info(
                    "engine stopped: of %d requests in flight at shutdown, %d finished and %d were "
                    "aborted; KV blocks in use: %d of %d",
                    self.in_flight_at_stop,
                    self.finished_while_stopping,
                    self.aborted_while_stopping,
                    engine.kv.num_used_blocks,
                    engine.kv.num_blocks,
                )
                return

    def take_commands(self, block: bool) -> list[Command]:
        """Pending commands (waits for one first when `block`)."""
        commands: list[Command] = []
        if block:
            commands.append(self.commands.get())
        while True:
            try:
                commands.append(self.commands.get_nowait())
            except queue.Empty:
                return commands

    def fail_all(self, error: BaseException) -> None:
        """Hand `error` to every in-flight request (the engine is gone)."""
        for sink in self.sinks.values():
            sink.put(error)
        self.sinks.clear()

    def _apply(self, command: Command) -> None:
        if isinstance(command, AddCommand):
            self._add(command)
        elif isinstance(command, AbortCommand):
            self.engine.abort(command.request_id)
            if self.sinks.pop(command.request_id, None) is not None and self.stop is not None:
                self.aborted_while_stopping += 1
        elif isinstance(command, CallCommand):
            try:
                command.sink.put((True, command.fn(self.engine)))
            except DetinfError as error:
                command.sink.put((False, error))
        elif self.stop is None:
            self.stop = command
            self.in_flight_at_stop = len(self.sinks)
            wait = "until they finish" if command.deadline is None else (
                f"for up to {max(0.0, command.deadline - time.monotonic()):.1f} s"
            )
            logger.info(
                "engine stopping: no new requests; %d in flight (holding %d KV blocks) may finish %s",
                len(self.sinks),
                self.engine.kv.num_used_blocks,
                wait,
            )

    def _add(self, command: AddCommand) -> None:
        try:
            self.engine.add_request(command.prompt_token_ids, command.params, command.request_id)
        except DetinfError as error:
            command.sink.put(error)
            return
        except Exception as error:  # noqa: BLE001 - this request's failure alone
            logger.error("adding request %s failed", command.request_id, exc_info=error)
            self.engine.abort(command.request_id)
            message = f"the request could not be admitted ({type(error).__name__})"
            command.sink.put(self.request_error(message))
            return
        self.sinks[command.request_id] = command.sink
        command.sink.put(ACCEPTED)

    def _deliver(self, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            sink = self.sinks.get(delta.request_id)
            if sink is None:
                continue
            sink.put(delta)
            if delta.finished:
                del self.sinks[delta.request_id]
                if self.stop is not None:
                    self.finished_while_stopping += 1

    def _past_deadline(self) -> bool:
        stop = self.stop
        return (
            stop is not None and stop.deadline is not None and bool(self.sinks)
            and time.monotonic() >= stop.deadline
        )

    def _abort_all(self) -> None:
        """The shutdown deadline passed: abort every in-flight request and free its KV blocks."""
        engine = self.engine
        used_before = engine.kv.num_used_blocks
        count = len(self.sinks)
        for request_id, sink in list(self.sinks.items()):
            engine.abort(request_id)
            sink.put(self.shutdown_error())
        self.sinks.clear()
        self.aborted_while_stopping += count
        logger.warning(
            "shutdown deadline passed: aborted %d in-flight requests, freeing %d KV blocks",
            count,
            used_before - engine.kv.num_used_blocks,
        )
