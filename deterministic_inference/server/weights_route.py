"""POST /update_weights: serve new weights from a safetensors directory (SGLang's update_weights_from_disk).

Contract: requests in flight when the update arrives finish on the old weights (and report the old
`system_fingerprint`); requests arriving while it waits or runs are held and then run on the new weights
(and report the new fingerprint); the prefix cache is flushed; the fingerprint's model digest becomes the
digest of the new weights. A bad `model_path` (no directory, no readable *.safetensors) or tensors that do
not match the served model (names, shapes) are a 400 answered before anything is held, and the old
weights keep serving.

The ordering comes from `WeightGate`, a readers/writer gate over HTTP requests: every request to another
endpoint is a reader for its whole life, streamed bodies included (`GateMiddleware`), and the update is
the writer: it stops new readers, waits for the current ones to finish, swaps the weights in the engine
thread (`AsyncEngine.update_weights`) and opens the gate again. A request therefore never straddles an
update, so the fingerprint a handler reads when it starts is the one its tokens were computed with.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import APIRouter, FastAPI
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from deterministic_inference.engine.weight_update import check_weights, read_weights_dir
from deterministic_inference.errors import InvalidRequestError
from deterministic_inference.server import schemas
from deterministic_inference.server.body import JSONBodyRoute
from deterministic_inference.server.errors import as_api_error
from deterministic_inference.server.formatting import json_response
from deterministic_inference.server.serving import ServingContext

PATH = "/update_weights"
# Requests that never wait for an update: the update itself, health, metrics and the API description.
UNGATED = frozenset({PATH, "/healthz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect"})
LOAD_FORMATS = (None, "auto", "safetensors")


class UpdateWeightsRequest(BaseModel):
    """SGLang's update_weights_from_disk body (the fields this server reads)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model_path: str = Field(
        min_length=1,
        description="directory on the server holding the new weights as *.safetensors (HF tensor names), "
        "e.g. written by rl.Policy.save_weights",
    )
    load_format: str | None = Field(default=None, description="'safetensors' (or 'auto'): the format read")


class UpdateWeightsResult(BaseModel):
    """The update took effect: new requests run on the new weights."""

    success: bool
    message: str
    system_fingerprint: str  # the new fingerprint (responses to new requests carry it)
    weights_digest: str  # sha256 of the new weights as the engine computes them


class WeightGate:
    """Readers/writer gate, writer first (see the module docstring). Single event loop; a reader's exit
    never awaits, so a cancelled request cannot leave its count behind."""

    def __init__(self) -> None:
        self._readers = 0
        self._open = asyncio.Event()  # set: readers may enter (no update waiting or running)
        self._open.set()
        self._idle = asyncio.Event()  # set: no reader inside
        self._idle.set()
        self._writer = asyncio.Lock()  # one update at a time

    @contextlib.asynccontextmanager
    async def reading(self) -> AsyncIterator[None]:
        """Hold the gate open for one request (waits while an update is pending)."""
        while not self._open.is_set():
            await self._open.wait()
        self._readers += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._readers -= 1
            if self._readers == 0:
                self._idle.set()

    @contextlib.asynccontextmanager
    async def writing(self) -> AsyncIterator[None]:
        """Close the gate to new requests and wait for the current ones to finish."""
        async with self._writer:
            self._open.clear()
            try:
                while self._readers:
                    await self._idle.wait()
                yield
            finally:
                self._open.set()


class GateMiddleware:
    """Runs every HTTP request outside UNGATED as a reader of `gate` (until its response is sent)."""

    def __init__(self, app: ASGIApp, gate: WeightGate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in UNGATED:
            await self.app(scope, receive, send)
            return
        async with self.gate.reading():
            await self.app(scope, receive, send)


def add_weight_update(app: FastAPI, ctx: ServingContext) -> None:
    """Register POST /update_weights and the gate's middleware (call before the auth middleware is
    added, so unauthenticated requests are refused without waiting at the gate)."""
    gate = WeightGate()
    router = APIRouter(route_class=JSONBodyRoute)

    @router.post(
        PATH,
        response_model=UpdateWeightsResult,
        responses=schemas.error_responses(400, 401, 503),
        tags=["sglang"],
    )
    async def update_weights(body: UpdateWeightsRequest) -> Response:
        """Load new weights from a safetensors directory; in-flight requests finish on the old ones."""
        try:
            return await _update(ctx, gate, body)
        except Exception as error:  # noqa: BLE001 - mapped to the right status by as_api_error
            return as_api_error(error).response()

    app.include_router(router)
    app.add_middleware(GateMiddleware, gate=gate)


async def _update(ctx: ServingContext, gate: WeightGate, body: UpdateWeightsRequest) -> Response:
    ctx.info()  # 503 while the engine is not serving
    if body.load_format not in LOAD_FORMATS:
        raise InvalidRequestError(
            f"load_format: {body.load_format!r} is not read; give 'safetensors' weights", param="load_format"
        )
    weights = await asyncio.to_thread(read_weights_dir, body.model_path, "model_path")
    spec = await ctx.engine.call(lambda engine: engine.spec)
    check_weights(weights, spec, "model_path")  # a 400 before any request is held
    async with gate.writing():
        info = await ctx.engine.update_weights(weights, "model_path")
        digest = await ctx.engine.call(lambda engine: engine.model_digest)
    return json_response(
        {
            "success": True,
            "message": "weights updated; the prefix cache was flushed",
            "system_fingerprint": info.system_fingerprint,
            "weights_digest": digest,
        }
    )
