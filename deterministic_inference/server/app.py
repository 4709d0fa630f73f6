"""FastAPI app factory: OpenAI-compatible endpoints over one `AsyncEngine`.

Start-up: the app starts serving at once and the engine is built (model load + self-check) in the
engine thread; `/healthz` answers 503 until that finished, and other endpoints answer 503 too.
If loading fails, `on_load_failure` is called (the `serve` command uses it to exit non-zero).
Shutdown (SIGTERM via uvicorn): uvicorn stops accepting connections and waits for in-flight
responses; then the lifespan drains and joins the engine thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from starlette.responses import PlainTextResponse, Response

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.async_engine import AsyncEngine, EngineInfo, EngineState
from deterministic_inference.engine.engine import Engine
from deterministic_inference.server.errors import as_api_error, install_error_handlers
from deterministic_inference.server.formatting import json_response
from deterministic_inference.server.metrics import ServerMetrics
from deterministic_inference.server.middleware import AuthMetricsMiddleware
from deterministic_inference.server.serving import ServingContext, created_now
from deterministic_inference.server.serving_chat import create_chat_completion
from deterministic_inference.server.serving_completions import create_completion
from deterministic_inference.server.serving_generate import generate

DEFAULT_MAX_WAITING = 256


@dataclass(frozen=True)
class ServerSettings:
    """Server-only settings (the engine's are in EngineConfig)."""

    api_key: str | None = None  # Bearer token required everywhere but /healthz; None = open
    served_model_name: str | None = None  # None = the model's own name
    max_waiting: int = DEFAULT_MAX_WAITING  # sequences admitted beyond max_num_seqs before 429


Handler = Callable[[ServingContext, Request], Awaitable[Response]]


def create_app(
    engine_config: EngineConfig,
    settings: ServerSettings | None = None,
    engine_factory: Callable[[], Engine] | None = None,
    on_load_failure: Callable[[str], None] | None = None,
    on_ready: Callable[[EngineInfo], None] | None = None,
) -> FastAPI:
    """A new app owning its own AsyncEngine (built when the app starts)."""
    settings = settings or ServerSettings()
    factory = engine_factory or (lambda: Engine(engine_config))
    async_engine = AsyncEngine(factory, capacity=engine_config.max_num_seqs + settings.max_waiting)
    async_engine.on_load_failure = on_load_failure
    async_engine.on_ready = on_ready
    metrics = ServerMetrics()
    ctx = ServingContext(async_engine, metrics, settings.served_model_name)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.stop()

    app = FastAPI(title="detinf", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    install_error_handlers(app)
    _add_routes(app, ctx)
    app.add_middleware(AuthMetricsMiddleware, api_key=settings.api_key, metrics=metrics)
    return app


def _handled(ctx: ServingContext, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(ctx, request)
        except Exception as error:  # every failure becomes an OpenAI error body
            return as_api_error(error).response()

    return endpoint


def _add_routes(app: FastAPI, ctx: ServingContext) -> None:
    app.add_api_route("/healthz", _healthz(ctx), methods=["GET"])
    app.add_api_route("/metrics", _handled(ctx, _metrics), methods=["GET"])
    app.add_api_route("/v1/models", _handled(ctx, _models), methods=["GET"])
    app.add_api_route("/v1/completions", _handled(ctx, create_completion), methods=["POST"])
    app.add_api_route("/v1/chat/completions", _handled(ctx, create_chat_completion), methods=["POST"])
    app.add_api_route("/generate", _handled(ctx, generate), methods=["POST"])
    app.add_api_route("/flush_cache", _handled(ctx, _flush_cache), methods=["POST"])


def _healthz(ctx: ServingContext) -> Callable[[], Awaitable[Response]]:
    async def healthz() -> Response:
        engine = ctx.engine
        if engine.ready and engine.info is not None:
            return json_response({"status": "ok", "system_fingerprint": engine.info.system_fingerprint})
        status = "failed" if engine.state is EngineState.FAILED else engine.state.value
        return json_response({"status": status, "error": engine.error}, status_code=503)

    return healthz


async def _metrics(ctx: ServingContext, _: Request) -> Response:
    text = ctx.metrics.render(ctx.engine.stats(), ctx.engine.ready)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


async def _models(ctx: ServingContext, _: Request) -> Response:
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


async def _flush_cache(ctx: ServingContext, _: Request) -> Response:
    ctx.info()
    flushed = await ctx.engine.call(lambda engine: engine.flush_prefix_cache())
    return json_response({"flushed_blocks": flushed, "system_fingerprint": ctx.info().system_fingerprint})
