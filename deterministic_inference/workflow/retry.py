"""Retries of requests to a remote OpenAI-compatible endpoint (``run --base-url``).

Transient failures are retried with bounded exponential backoff: connection errors (refused, reset,
closed before the answer: a server restarting mid-request), HTTP 429, 502, 503 and 504. A ``Retry-After``
header in seconds is honoured up to the cap. A request is sent again only when no answer arrived; once
any answer arrived (a 200 or another status) it is final. Read timeouts are not retried: the server may
still be working on the request.

Every retry is recorded (request, attempt, reason, wait), and the answers of a run with retries must
carry one ``system_fingerprint``: a server that came back with other weights or software would mix two
runs into one, so the run stops and says so.
"""

from __future__ import annotations

import asyncio
import datetime
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

import httpx

from deterministic_inference.errors import WorkflowError

RETRY_STATUSES = (429, 502, 503, 504)
_FINAL_TRANSPORT_ERRORS = (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout)


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry."""

    attempts: int = 6  # sends per request at most
    base_seconds: float = 0.5  # first wait; doubled each time
    cap_seconds: float = 8.0  # no wait longer than this

    def delay(self, attempt: int, retry_after: float | None) -> float:
        """Seconds to wait after failed attempt `attempt` (1-based)."""
        wait = self.base_seconds * 2 ** (attempt - 1) if retry_after is None else retry_after
        return max(0.0, min(self.cap_seconds, wait))


@dataclass
class RetryLog:
    """Every retry of a run, and the one system_fingerprint its answers must share once one happened."""

    stream: TextIO | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    fingerprints: list[str] = field(default_factory=list)  # in order of first appearance
    resumed: bool = False  # answers of a killed run were read back: they count as one run with the new
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, request_id: str, attempt: int, reason: str, wait: float) -> None:
        """Note one failed attempt that will be retried."""
        event = {"request_id": request_id, "attempt": attempt, "reason": reason,
                 "wait_seconds": round(wait, 3), "at": _now()}
        with self._lock:
            self.events.append(event)
        if self.stream is not None:
            print(f"retry: {request_id} attempt {attempt} failed ({reason}); retrying in {wait:.1f} s",
                  file=self.stream, flush=True)

    def answered(self, request_id: str, system_fingerprint: object) -> None:
        """Note an answer's fingerprint; stop the run when it differs from earlier ones after a retry."""
        if not isinstance(system_fingerprint, str):
            return
        with self._lock:
            if system_fingerprint not in self.fingerprints:
                self.fingerprints.append(system_fingerprint)
            self.check()

    def check(self) -> None:
        """Refuse a run whose answers carry more than one fingerprint once a retry happened."""
        if (self.events or self.resumed) and len(self.fingerprints) > 1:
            raise WorkflowError(f"the endpoint's system_fingerprint changed during the run "
                                f"({self.fingerprints[0]}, then {self.fingerprints[1]}) while requests "
                                "were retried or the run resumed: it restarted with other weights or "
                                "software, so the answers are not one run's; no run directory was written, "
                                "run again")


def send_with_retries(send: Callable[[], httpx.Response], request_id: str, policy: RetryPolicy,
                      log: RetryLog, where: str,
                      sleep: Callable[[float], None] = time.sleep) -> httpx.Response:
    """The first answer to `send` (any status but a retryable one), retrying transient failures."""
    attempt = 0
    while True:
        attempt += 1
        try:
            response = send()
        except httpx.TransportError as error:
            failure = _transport_failure(error, request_id, where)
        else:
            status_failure = _status_failure(response)
            if status_failure is None:
                return response
            failure = status_failure
        sleep(_next_wait(failure, attempt, request_id, policy, log, where))


async def send_with_retries_async(send: Callable[[], Awaitable[httpx.Response]], request_id: str,
                                  policy: RetryPolicy, log: RetryLog, where: str) -> httpx.Response:
    """`send_with_retries` for an async client."""
    attempt = 0
    while True:
        attempt += 1
        try:
            response = await send()
        except httpx.TransportError as error:
            failure = _transport_failure(error, request_id, where)
        else:
            status_failure = _status_failure(response)
            if status_failure is None:
                return response
            failure = status_failure
        await asyncio.sleep(_next_wait(failure, attempt, request_id, policy, log, where))


def _transport_failure(error: httpx.TransportError, request_id: str, where: str) -> tuple[str, float | None]:
    """(reason, no Retry-After) of a connection failure; raises for a timeout, which is final."""
    if isinstance(error, _FINAL_TRANSPORT_ERRORS):
        raise WorkflowError(f"{where}: request {request_id} timed out ({type(error).__name__}); "
                            "raise the timeout")
    return f"{type(error).__name__}: {error}"[:200], None


def _status_failure(response: httpx.Response) -> tuple[str, float | None] | None:
    """(reason, Retry-After) of a retryable status, None for an answer."""
    if response.status_code not in RETRY_STATUSES:
        return None
    return f"HTTP {response.status_code}", _retry_after(response)


def _next_wait(failure: tuple[str, float | None], attempt: int, request_id: str,
               policy: RetryPolicy, log: RetryLog, where: str) -> float:
    """The wait before the next attempt, after logging it; raises when the attempts are used up."""
    reason, retry_after = failure
    if attempt >= policy.attempts:
        raise WorkflowError(f"{where}: request {request_id} failed {attempt} times, last: {reason}; "
                            "the endpoint is not answering")
    wait = policy.delay(attempt, retry_after)
    log.record(request_id, attempt, reason, wait)
    return wait


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after", "")
    try:
        return float(value)
    except ValueError:
        return None


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
