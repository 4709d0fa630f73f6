"""A loopback HTTP proxy in front of a real server that fails on a script: 503s, 429s, answers dropped
after the server computed them, and a restart (the port refuses connections for a moment).

A restart stops listening before the client sees its connection close, and stays down until the client's
own retry of that request has been refused (its backoff wait plus RESTART_MARGIN_SECONDS): the refusal is
part of the script, not a race with the retry's timing."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from deterministic_inference.workflow.retry import RetryPolicy

RESTART_MARGIN_SECONDS = 1.0  # down this long after the client's retry is due
POLL_SECONDS = 0.05  # how soon serve_forever notices a shutdown (a short window of queued connections)


class FlakyEndpoint:
    """The proxy's state: the failure script and what it forwarded and delivered."""

    def __init__(self, upstream: str, script: list[str], rewrite_fingerprint_after_restart: bool = False):
        self.upstream = upstream
        self.script = list(script)  # one action per POST, in arrival order; then "forward"
        self.rewrite = rewrite_fingerprint_after_restart
        self.restarted = False
        self.delivered: Counter[str] = Counter()  # body digest -> answers delivered to the client
        self.sent: Counter[str] = Counter()  # body digest -> POSTs received (the client's attempt number)
        self.forwarded = 0  # POSTs the real server answered
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None
        self.port = 0

    def next_action(self, body: bytes) -> tuple[str, int]:
        """The scripted action of the next POST, and which attempt of its request this POST is."""
        with self.lock:
            digest = hashlib.sha256(body).hexdigest()
            self.sent[digest] += 1
            return (self.script.pop(0) if self.script else "forward"), self.sent[digest]

    def forward(self, method: str, path: str, body: bytes) -> httpx.Response:
        """Send to the real server."""
        response = httpx.request(method, self.upstream + path, content=body or None, timeout=120,
                                 headers={"content-type": "application/json"} if body else None)
        if method == "POST":
            with self.lock:
                self.forwarded += 1
        return response

    def start(self) -> None:
        """Listen (again) on the port."""
        server = ThreadingHTTPServer(("127.0.0.1", self.port), _handler(self))
        server.daemon_threads = True
        self.port = server.server_address[1]
        self.server = server
        threading.Thread(target=server.serve_forever, args=(POLL_SECONDS,), daemon=True).start()

    def go_down(self, attempt: int) -> None:
        """Stop listening now (from a handler thread); listen again once the client's retry of attempt
        `attempt`, due after RetryPolicy's wait, has found the port closed."""
        assert self.server is not None
        self.server.shutdown()
        self.server.server_close()
        down_seconds = RetryPolicy().delay(attempt, None) + RESTART_MARGIN_SECONDS

        def come_back() -> None:
            time.sleep(down_seconds)
            self.restarted = True
            self.start()
        threading.Thread(target=come_back, daemon=True).start()

    @property
    def base_url(self) -> str:
        """Where clients connect."""
        return f"http://127.0.0.1:{self.port}"


def _handler(state: FlakyEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._reply(state.forward("GET", self.path, b""), b"")

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            action, attempt = state.next_action(body)
            if action in ("503", "429"):
                self.send_response(int(action))
                self.send_header("retry-after", "0")
                self.send_header("content-length", "0")
                self.end_headers()
                return
            if action in ("drop", "restart"):  # the server computes the answer, the client never sees it
                state.forward("POST", self.path, body)
                self.close_connection = True
                if action == "restart":
                    state.go_down(attempt)  # before this connection closes
                return
            self._reply(state.forward("POST", self.path, body), body)

        def _reply(self, response: httpx.Response, body: bytes) -> None:
            content = response.content
            if state.rewrite and state.restarted and body:
                document = json.loads(content)
                document["system_fingerprint"] = "detinf-0000000000000000"  # came back with other weights
                content = json.dumps(document).encode()
            self.send_response(response.status_code)
            self.send_header("content-type", response.headers.get("content-type", "application/json"))
            self.send_header("content-length", str(len(content)))
            self.end_headers()
            self.wfile.write(content)
            if body and response.status_code == 200:
                with state.lock:
                    state.delivered[hashlib.sha256(body).hexdigest()] += 1

    return Handler


@contextmanager
def flaky_endpoint(upstream: str, script: list[str], rewrite_fingerprint_after_restart: bool = False
                   ) -> Iterator[FlakyEndpoint]:
    """A running proxy; shut down after the block."""
    endpoint = FlakyEndpoint(upstream, script, rewrite_fingerprint_after_restart)
    endpoint.start()
    try:
        yield endpoint
    finally:
        if endpoint.server is not None:
            endpoint.server.shutdown()
            endpoint.server.server_close()
