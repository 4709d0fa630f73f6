"""FastAPI app factory: OpenAI-compatible endpoints over one `AsyncEngine`.

Start-up: the app starts serving at once and the engine is built (model load + self-check) in the
engine thread; `/healthz` answers 503 until that finished, and other endpoints answer 503 too. (`detinf
serve` starts the engine before the app: it binds its port only once the engine is ready, see
`server/process.py`.)
If loading fails, `on_load_failure` is called (the `serve` command uses it to exit non-zero); if the
engine dies while serving, `/healthz` turns 503 at once, in-flight requests get 503 and `on_failure` is
called (the `serve` command exits non-zero for its supervisor to restart it).

Shutdown (SIGTERM via uvicorn): uvicorn stops accepting connections and waits for in-flight responses
up to its graceful timeout (`ServerSettings.shutdown_timeout`), then cancels them; then the lifespan
stops the engine, aborting whatever is still in flight and freeing its KV blocks (logged).

Request bodies are typed FastAPI parameters (`server/protocol.py`) parsed by `JSONBodyRoute`, and
responses are described by `server/schemas.py`, so `/openapi.json` (and `/docs`) document the API.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.responses import PlainTextResponse, Response

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.async_engine import AsyncEngine, EngineInfo, EngineState
from deterministic_inference.engine.engine import Engine
from deterministic_inference.server import schemas
from deterministic_inference.server.body import JSONBodyRoute
from deterministic_inference.server.errors import as_api_error, install_error_handlers
from deterministic_inference.server.formatting import json_response
from deterministic_inference.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from deterministic_inference.server.metrics import ServerMetrics
from deterministic_inference.server.middleware import AuthMetricsMiddleware
from deterministic_inference.server.protocol import ChatCompletionRequest, CompletionRequest
from deterministic_inference.server.protocol_generate import GenerateRequest
from deterministic_inference.server.serving import ServingContext, created_now
from deterministic_inference.server.serving_chat import create_chat_completion
from deterministic_inference.server.serving_completions import create_completion
from deterministic_inference.server.serving_generate import generate
from deterministic_inference.server.weights_route import add_weight_update

DEFAULT_MAX_WAITING = 256
STREAMED: dict[str, type[BaseModel]] = {  # path -> the model of each streamed event
    "/v1/completions": schemas.CompletionResponse,
    "/v1/chat/completions": schemas.ChatCompletionChunk,
    "/generate": schemas.GenerateItem,
}
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
ENGINE_STOP_TIMEOUT = 1.0  # at lifespan shutdown uvicorn already gave in-flight responses their time
logger = logging.getLogger("detinf.server")


@dataclass(frozen=True)
class ServerSettings:
    """Server-only settings (the engine's are in EngineConfig)."""

    api_key: str | None = None  # Bearer token required everywhere but /healthz; None = open
    served_model_name: str | None = None  # None = the model's own name
    max_waiting: int = DEFAULT_MAX_WAITING  # sequences admitted beyond max_num_seqs before 429
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT  # seconds in-flight requests may take at shutdown


def create_app(
    engine_config: EngineConfig,
    settings: ServerSettings | None = None,
    engine_factory: Callable[[], Engine] | None = None,
    on_load_failure: Callable[[str], None] | None = None,
    on_ready: Callable[[EngineInfo], None] | None = None,
    on_failure: Callable[[str], None] | None = None,
) -> FastAPI:
    """A new app owning its own AsyncEngine (built when the app starts). `engine_factory` builds the
    engine (tests pass one with fault injection); `app.state.stopped_cleanly` says after shutdown
    whether the engine stopped cleanly."""
    settings = settings or ServerSettings()
    factory = engine_factory or (lambda: Engine(engine_config))
    async_engine = AsyncEngine(factory, capacity=engine_config.max_num_seqs + settings.max_waiting)
    async_engine.on_load_failure = on_load_failure
    async_engine.on_ready = on_ready
    async_engine.on_failure = on_failure
    metrics = ServerMetrics(
        model_name=lambda: settings.served_model_name or (async_engine.info.model_name if async_engine.info
                                                          else None),
        engine_stats=async_engine.stats,
        ready=lambda: async_engine.ready,
        fingerprint=lambda: async_engine.info.system_fingerprint if async_engine.info else None,
    )
    ctx = ServingContext(async_engine, metrics, settings.served_model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if async_engine.state is EngineState.NEW:  # `detinf serve` starts it before binding the port
            async_engine.start()
        try:
            yield
        finally:
            # uvicorn waited up to shutdown_timeout for the in-flight responses and cancelled the rest;
            # whatever the engine still runs now is aborted after at most ENGINE_STOP_TIMEOUT.
            limit = min(settings.shutdown_timeout, ENGINE_STOP_TIMEOUT)
            app.state.stopped_cleanly = await async_engine.stop(timeout=limit)

    app = FastAPI(
        title="detinf",
        summary="Bitwise reproducible LLM inference: OpenAI-compatible and SGLang-style endpoints",
        version="1",
        lifespan=lifespan,
        docs_url="/docs",
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.state.ctx = ctx
    app.state.stopped_cleanly = False
    install_error_handlers(app)
    _add_routes(app, ctx)
    add_weight_update(app, ctx)  # POST /update_weights and its gate (before the auth middleware)
    _publish_schema(app, secured=settings.api_key is not None)
    app.add_middleware(AuthMetricsMiddleware, api_key=settings.api_key, metrics=metrics)
    return app


async def _guarded(work: Awaitable[Response]) -> Response:
    """Every failure of a handler becomes an OpenAI error body."""
    try:
        return await work
    except Exception as error:  # noqa: BLE001 - mapped to the right status by as_api_error
        return as_api_error(error).response()


def _add_routes(app: FastAPI, ctx: ServingContext) -> None:
    _add_generation_routes(app, ctx)

    @app.get(
        "/v1/models",
        response_model=schemas.ModelList,
        responses=schemas.error_responses(401, 503),
        tags=["openai"],
    )
    async def models() -> Response:
        """The served model, with its system_fingerprint."""
        return await _guarded(_models(ctx))

    @app.post(
        "/flush_cache",
        response_model=schemas.FlushResult,
        responses=schemas.error_responses(401, 503),
        tags=["admin"],
    )
    async def flush_cache() -> Response:
        """Drop every prefix-cache block no running request holds."""
        return await _guarded(_flush_cache(ctx))

    @app.post(
        "/reset_prefix_cache",
        response_model=schemas.FlushResult,
        responses=schemas.error_responses(401, 503),
        tags=["admin"],
    )
    async def reset_prefix_cache() -> Response:
        """vLLM's name for /flush_cache: drop every prefix-cache block no running request holds."""
        return await _guarded(_flush_cache(ctx))

    @app.get(
        "/healthz", response_model=schemas.Health, responses={503: {"model": schemas.Health}}, tags=["admin"]
    )
    async def healthz() -> Response:
        """200 while serving; 503 while loading, shutting down, or after the engine failed."""
        return _healthz(ctx)

    @app.get(
        "/metrics", response_class=PlainTextResponse, responses=schemas.error_responses(401), tags=["admin"]
    )
    async def metrics() -> Response:
        """Prometheus metrics (text exposition format 0.0.4; vLLM's names where the meaning is the same)."""
        return Response(ctx.metrics.render(), media_type=METRICS_CONTENT_TYPE)


def _add_generation_routes(app: FastAPI, ctx: ServingContext) -> None:
    """The endpoints with a JSON body (parsed strictly by JSONBodyRoute)."""
    router = APIRouter(route_class=JSONBodyRoute)
    errors = schemas.error_responses(400, 401, 404, 429, 500, 503)

    @router.post(
        "/v1/completions",
        response_model=schemas.CompletionResponse,
        responses={**schemas.event_stream(schemas.CompletionResponse), **errors},
        tags=["openai"],
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """Text completion (OpenAI legacy completions; echo + logprobs for lm-eval scoring)."""
        return await _guarded(create_completion(ctx, body, request))

    @router.post(
        "/v1/chat/completions",
        response_model=schemas.ChatCompletionResponse,
        responses={**schemas.event_stream(schemas.ChatCompletionChunk), **errors},
        tags=["openai"],
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """Chat completion through the model's chat template."""
        return await _guarded(create_chat_completion(ctx, body, request))

    @router.post(
        "/generate",
        response_model=schemas.GenerateItem | list[schemas.GenerateItem],
        responses={**schemas.event_stream(schemas.GenerateItem), **errors},
        tags=["sglang"],
    )
    async def generate_endpoint(body: GenerateRequest, request: Request) -> Response:
        """SGLang-style native generation (`sampling_params.sampling_seed`)."""
        return await _guarded(generate(ctx, body, request))

    app.include_router(router)


def _healthz(ctx: ServingContext) -> Response:
    engine = ctx.engine
    if engine.ready and engine.info is not None:
        return json_response({"status": "ok", "system_fingerprint": engine.info.system_fingerprint})
    status = "failed" if engine.state is EngineState.FAILED else engine.state.value
    return json_response({"status": status, "error": engine.public_error}, status_code=503)


async def _models(ctx: ServingContext) -> Response:
    info = ctx.info()
    card = {
        "id": ctx.model_name,
        "object": "model",
        "created": created_now(),
        "owned_by": "detinf",
        "root": info.model_name,
        "max_model_len": info.max_model_len,
        "system_fingerprint": info.system_fingerprint,
    }
    return json_response({"object": "list", "data": [card]})


async def _flush_cache(ctx: ServingContext) -> Response:
    ctx.info()
    flushed = await ctx.engine.call(lambda engine: engine.flush_prefix_cache())
    return json_response({"flushed_blocks": flushed, "system_fingerprint": ctx.info().system_fingerprint})


def _publish_schema(app: FastAPI, secured: bool) -> None:
    """The OpenAPI document: FastAPI's, without its 422 answers (bad bodies are OpenAI-style 400s), with
    the event schema of every streaming endpoint, and with the Bearer scheme when an API key is
    required."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = FastAPI.openapi(app)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        models: list[type[BaseModel]] = [*STREAMED.values(), schemas.ErrorResponse]
        _, defs = models_json_schema(
            [(model, "serialization") for model in models], ref_template="#/components/schemas/{model}"
        )
        for name, definition in defs.get("$defs", {}).items():
            components.setdefault(name, definition)
        for path, model in STREAMED.items():
            content = schema["paths"][path]["post"]["responses"]["200"]["content"]
            content["text/event-stream"] = {"schema": schemas.sse_event_schema(model)}
        if secured:
            schema.setdefault("components", {})["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer"}
            }
            schema["security"] = [{"bearer": []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
