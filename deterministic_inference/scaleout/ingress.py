"""The router of the replicated server: a Ray Serve ingress in front of N `EngineReplica` deployments.

Every client request reaches `Router.__call__`. `/healthz` and `/metrics` are answered here (they
describe the whole deployment); `/flush_cache` goes to every routable replica; any other request is
forwarded as it arrived to one replica chosen by `routing.choose_replica` (prefix affinity, then least
loaded), whose server app answers it, so the API is the one-process server's. The API key is checked
here as well (same 401 body) so unauthenticated traffic never reaches a replica.

Joining: a background task asks every replica for its state and engine fingerprint (`describe`) each
`POLL_INTERVAL` seconds. The deployment's fingerprint is the pinned `expected_system_fingerprint`, or
else replica 0's (the anchor: deterministic, never a race of who loads first). A ready replica whose
fingerprint differs is refused: never routed to, and listed with the differing parts in /healthz and
/metrics. Responses keep the replica's `system_fingerprint`, equal to the deployment's by that check.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from deterministic_inference.scaleout import routing
from deterministic_inference.scaleout.asgi_bridge import ForwardedRequest, ResponseHead
from deterministic_inference.scaleout.metrics_merge import gauge, merge_expositions
from deterministic_inference.server.errors import APIError
from deterministic_inference.server.formatting import json_response
from deterministic_inference.server.middleware import OPEN_PATHS, bearer_matches

POLL_INTERVAL = 1.0  # seconds between join / health polls of the replicas
DESCRIBE_TIMEOUT = 10.0  # a replica that does not answer `describe` this fast is unreachable
logger = logging.getLogger("detinf.scaleout")


@dataclass(frozen=True)
class RouterSettings:
    """What the router needs besides the replica handles."""

    api_key: str | None = None
    expected_system_fingerprint: str | None = None  # pin; None = replica 0's fingerprint


@dataclass
class ReplicaSlot:
    """The router's view of one replica."""

    name: str
    handle: Any  # ray.serve DeploymentHandle of an EngineReplica
    state: str = "joining"  # the engine state it reported, or "unreachable"
    system_fingerprint: str | None = None
    fingerprint: dict[str, Any] | None = None
    routable: bool = False
    reason: str | None = None  # why it is not routed to
    inflight: int = 0
    routed: int = 0
    described: dict[str, Any] = field(default_factory=dict)


class Router:
    """Serve ingress deployment class (see the module docstring)."""

    def __init__(self, settings: RouterSettings, *replicas: Any) -> None:
        self.settings = settings
        self.slots = [ReplicaSlot(f"replica-{i}", handle) for i, handle in enumerate(replicas)]
        self.reference: dict[str, Any] | None = None  # the deployment's full fingerprint, once known
        self._poller: asyncio.Task[None] | None = None

    # ----- joining ------------------------------------------------------------------------------

    async def poll_once(self) -> None:
        """Ask every replica for its state and fingerprint; decide which are routable."""
        described = await asyncio.gather(*(self._describe(slot) for slot in self.slots))
        for slot, info in zip(self.slots, described, strict=True):
            slot.described = info or {}
            slot.state = info["state"] if info else "unreachable"
            slot.system_fingerprint = info.get("system_fingerprint") if info else None
            slot.fingerprint = info.get("fingerprint") if info else None
        anchor = self.slots[0] if self.slots else None
        if self.reference is None and anchor is not None and anchor.fingerprint is not None:
            pinned = self.settings.expected_system_fingerprint
            if pinned is None or anchor.system_fingerprint == pinned:
                self.reference = anchor.fingerprint
        for slot in self.slots:
            slot.routable, slot.reason = self._judge(slot)

    def _judge(self, slot: ReplicaSlot) -> tuple[bool, str | None]:
        if slot.state != "ready" or slot.fingerprint is None:
            return False, slot.described.get("error") or f"engine {slot.state}"
        differences = self._differences(slot)
        if differences is None:
            return False, "waiting for replica-0 to define the deployment's fingerprint"
        if differences:
            return False, "fingerprint differs from the deployment's: " + "; ".join(differences[:4])
        return True, None

    def _differences(self, slot: ReplicaSlot) -> list[str] | None:
        """How the slot's fingerprint differs from the deployment's; None while either is unknown."""
        pinned = self.settings.expected_system_fingerprint
        if slot.fingerprint is None:
            return None
        if pinned is not None and slot.system_fingerprint != pinned:
            return [f"system_fingerprint: {slot.system_fingerprint} != pinned {pinned}"]
        if self.reference is None:
            return None
        return routing.fingerprint_differences(self.reference, slot.fingerprint)

    async def _describe(self, slot: ReplicaSlot) -> dict[str, Any] | None:
        try:
            result: dict[str, Any] = await asyncio.wait_for(
                slot.handle.describe.remote(), DESCRIBE_TIMEOUT
            )
            return result
        except Exception as error:  # noqa: BLE001 - a dead or restarting replica is "unreachable"
            logger.warning("%s: describe failed (%s)", slot.name, type(error).__name__)
            return None

    async def _poll_forever(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.poll_once()
            await asyncio.sleep(POLL_INTERVAL)

    def _ensure_polling(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    # ----- requests -----------------------------------------------------------------------------

    async def __call__(self, request: Request) -> Response:
        """Answer /healthz and /metrics here, broadcast /flush_cache, forward everything else."""
        self._ensure_polling()
        path = request.url.path
        if path == "/healthz":
            if self.reference is None:
                await self.poll_once()
            return self.health()
        if self.settings.api_key and path not in OPEN_PATHS:
            if not bearer_matches(request.headers.get("authorization", "").encode("latin-1") or None,
                                  self.settings.api_key):
                return APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                "authentication_error", code="invalid_api_key",
                                headers={"WWW-Authenticate": "Bearer"}).response()
        forwarded = await _forwarded(request)
        if path == "/metrics" and request.method == "GET":
            return await self.metrics(forwarded)
        if path == "/flush_cache" and request.method == "POST":
            return await self.flush_cache(forwarded)
        key = routing.affinity_key(forwarded.body) if request.method == "POST" else ""
        return await self.forward(key, forwarded)

    def health(self) -> Response:
        """200 with every replica's state while at least one replica is routable; else 503."""
        routable = [slot for slot in self.slots if slot.routable]
        document = {
            "status": "ok" if routable else "unavailable",
            "system_fingerprint": self._reference_id(),
            "replicas": [
                {"name": slot.name, "state": slot.state, "routable": slot.routable,
                 "system_fingerprint": slot.system_fingerprint, "reason": slot.reason}
                for slot in self.slots
            ],
        }
        return json_response(document, status_code=200 if routable else 503)

    def _reference_id(self) -> str | None:
        if self.settings.expected_system_fingerprint is not None:
            return self.settings.expected_system_fingerprint
        return self.slots[0].system_fingerprint if self.reference is not None else None

    async def forward(
        self, key: str, forwarded: ForwardedRequest, slot: ReplicaSlot | None = None
    ) -> Response:
        """Send one request to the chosen replica (or `slot`) and stream its response back."""
        if slot is None:
            routable = [s for s in self.slots if s.routable]
            loads = {s.name: s.inflight for s in routable}
            chosen = routing.choose_replica(key, loads, [s.name for s in routable])
            if chosen is None:
                return _unavailable(self.slots)
            slot = next(s for s in routable if s.name == chosen)
        slot.inflight += 1
        slot.routed += 1
        try:
            stream = slot.handle.options(stream=True).handle.remote(forwarded)
            head = await stream.__anext__()
        except BaseException:
            slot.inflight -= 1
            logger.exception("%s: forwarding failed", slot.name)
            return APIError(503, f"{slot.name} failed while answering; retry", "service_unavailable",
                            code="replica_unavailable", headers={"Retry-After": "1"}).response()
        if not isinstance(head, ResponseHead):  # pragma: no cover - the bridge yields the head first
            slot.inflight -= 1
            raise RuntimeError("replica answered without a response head")
        response = StreamingResponse(_rest(stream, slot), status_code=head.status)
        response.raw_headers = list(head.headers)
        return response

    async def metrics(self, forwarded: ForwardedRequest) -> Response:
        """The router's replica gauges, then every reachable replica's metrics labelled by replica."""
        own = [
            gauge("replica_routable", "1 when the router sends requests to the replica (ready, same "
                  "fingerprint)", [({"replica": s.name}, int(s.routable)) for s in self.slots]),
            gauge("replica_fingerprint_match", "1 when the replica's engine fingerprint equals the "
                  "deployment's, 0 when it differs or is unknown",
                  [({"replica": s.name, "system_fingerprint": s.system_fingerprint or ""},
                    int(self._differences(s) == []))
                   for s in self.slots]),
            gauge("replica_inflight_requests", "requests the router has in flight on the replica",
                  [({"replica": s.name}, s.inflight) for s in self.slots]),
            gauge("replica_routed_requests", "requests the router has sent to the replica",
                  [({"replica": s.name}, s.routed) for s in self.slots]),
        ]
        reachable = [s for s in self.slots if s.state not in ("unreachable", "joining")]
        texts = await asyncio.gather(*(_collect(s, forwarded) for s in reachable))
        merged = merge_expositions([(s.name, text) for s, text in zip(reachable, texts, strict=True)
                                    if text is not None])
        return Response("".join(own) + merged, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def flush_cache(self, forwarded: ForwardedRequest) -> Response:
        """Flush every routable replica's prefix cache; the sum of the flushed blocks."""
        routable = [s for s in self.slots if s.routable]
        if not routable:
            return _unavailable(self.slots)
        texts = await asyncio.gather(*(_collect(s, forwarded) for s in routable))
        total = 0
        for text in texts:
            with contextlib.suppress(ValueError, TypeError, KeyError):
                total += int(json.loads(text or "")["flushed_blocks"])
        return json_response({"flushed_blocks": total, "system_fingerprint": self._reference_id()})


async def _forwarded(request: Request) -> ForwardedRequest:
    client = (request.client.host, request.client.port) if request.client else None
    return ForwardedRequest(
        method=request.method,
        path=request.url.path,
        query_string=request.url.query.encode("latin-1"),
        headers=tuple((bytes(k), bytes(v)) for k, v in request.headers.raw),
        body=await request.body(),
        client=client,
    )


async def _rest(stream: Any, slot: ReplicaSlot) -> AsyncIterator[bytes]:
    """The body chunks after the head; cancels the replica's call if the client goes away."""
    try:
        async for chunk in stream:
            yield chunk
    finally:
        slot.inflight -= 1
        with contextlib.suppress(Exception):
            stream.cancel()


async def _collect(slot: ReplicaSlot, forwarded: ForwardedRequest) -> str | None:
    """A replica's whole response body to `forwarded` as text (None if it failed)."""
    try:
        chunks = [item async for item in slot.handle.options(stream=True).handle.remote(forwarded)
                  if isinstance(item, bytes)]
    except Exception:  # noqa: BLE001 - an unreachable replica contributes nothing
        return None
    return b"".join(chunks).decode("utf-8", "replace")


def _unavailable(slots: list[ReplicaSlot]) -> Response:
    states = ", ".join(f"{s.name}: {s.reason or s.state}" for s in slots)
    return APIError(503, f"no replica can take requests yet ({states}); retry when /healthz returns 200",
                    "service_unavailable", code="no_replica_ready", headers={"Retry-After": "1"}).response()
