"""`detinf serve` (OpenAI-compatible server) and `detinf audit` (determinism audit of any endpoint).

`serve` builds the engine (model load, self-check) before it binds its port: a model or engine that cannot
start is one line on stderr, with no server start-up line before it (`server/process.py`).

Exit codes of `serve`: 0 after a clean shutdown (SIGTERM/SIGINT: stop accepting, let in-flight requests
finish for up to --shutdown-timeout seconds, abort the rest); 1 when the engine failed to load, died
while serving (the process exits within a few seconds so a supervisor restarts it) or did not stop.
Every shutdown is bounded (`server/process.py`). The environment variable DETINF_FAULT_INJECTION (read
once at start-up; see `engine/faults.py`) injects engine faults for tests.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

from deterministic_inference.cli.options import add_engine_options, engine_config_from_args

if TYPE_CHECKING:
    from deterministic_inference.config import EngineConfig
    from deterministic_inference.engine.async_engine import EngineInfo
    from deterministic_inference.server.app import ServerSettings

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def register(subparsers: Any) -> None:
    """Adds `serve` and `audit`."""
    _register_serve(subparsers)
    from deterministic_inference.audit.cli import register_audit

    register_audit(subparsers)


def _register_serve(subparsers: Any) -> None:
    parser = subparsers.add_parser("serve", help="serve the OpenAI-compatible API (default: embedded model)")
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"interface to bind (default {DEFAULT_HOST})")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT})")
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (default: $DETINF_API_KEY if set)",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="name clients use in `model` (default: the model's)"
    )
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        help="sequences queued beyond --max-num-seqs before 429 (default 256)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=None,
        help="seconds in-flight requests may take to finish after SIGTERM/SIGINT before they are aborted "
        "(default 30)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
        help="server log verbosity (default info)",
    )
    scale = parser.add_argument_group("replicas (Ray Serve; plain serve never imports Ray)")
    scale.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="serve N engine replicas behind this endpoint with Ray Serve (prefix-affinity routing)",
    )
    scale.add_argument(
        "--ray-address",
        default=None,
        help="Ray cluster to deploy on (host:port of its GCS); default: a local Ray instance on loopback",
    )
    scale.add_argument(
        "--expect-fingerprint",
        default=None,
        help="with --replicas: the system_fingerprint replicas must have (default: replica 0's)",
    )
    add_engine_options(parser)
    parser.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """`detinf serve`: one engine in this process, or Ray Serve replicas (exit codes: module docstring)."""
    config = engine_config_from_args(args)
    settings = _server_settings(args)
    from deterministic_inference.server.process import configure_logging

    configure_logging(args.log_level)
    if args.replicas is not None or args.ray_address is not None:
        return _run_replicated(args, config, settings)
    return _run_single(args, config, settings)


def _server_settings(args: argparse.Namespace) -> ServerSettings:
    """The server-only flags as `ServerSettings`; ConfigError naming the flag when one is out of range."""
    from deterministic_inference.errors import ConfigError
    from deterministic_inference.server.app import (
        DEFAULT_MAX_WAITING,
        DEFAULT_SHUTDOWN_TIMEOUT,
        ServerSettings,
    )

    if args.max_waiting is not None and args.max_waiting < 0:
        raise ConfigError("--max-waiting must be >= 0")
    timeout = DEFAULT_SHUTDOWN_TIMEOUT if args.shutdown_timeout is None else args.shutdown_timeout
    if not timeout >= 0:
        raise ConfigError("--shutdown-timeout must be >= 0 seconds")
    return ServerSettings(
        api_key=args.api_key or os.environ.get("DETINF_API_KEY") or None,
        served_model_name=args.served_model_name,
        max_waiting=DEFAULT_MAX_WAITING if args.max_waiting is None else args.max_waiting,
        shutdown_timeout=timeout,
    )


def _run_single(args: argparse.Namespace, config: EngineConfig, settings: ServerSettings) -> int:
    """One engine behind uvicorn. The engine is built before the port is bound: a model or engine that
    cannot start is one line on stderr and exit 1, with no server start-up line before it."""
    from deterministic_inference.engine.engine import Engine
    from deterministic_inference.engine.faults import ENV_VAR, FaultInjection
    from deterministic_inference.server.app import create_app
    from deterministic_inference.server.process import BoundedServer, make_server, serve_when_engine_ready

    faults = FaultInjection.parse(os.environ.get(ENV_VAR, ""))  # read once, at start-up (tests only)
    failures: list[str] = []
    holder: list[BoundedServer] = []

    def on_failure(summary: str) -> None:
        failures.append(summary)
        print(f"detinf serve: error: the engine failed, exiting for a restart: {summary}", file=sys.stderr)
        holder[0].exit_after_failure()

    def build_engine() -> Engine:  # runs in the engine thread
        return Engine(config, faults=faults)

    app = create_app(config, settings, engine_factory=build_engine, on_failure=on_failure)
    engine = app.state.ctx.engine
    timeout = settings.shutdown_timeout
    server = make_server(
        app,
        args.host,
        args.port,
        args.log_level,
        timeout,
        on_exit_signal=lambda: engine.begin_stop_threadsafe(timeout),
        on_started=lambda: _print_ready(engine.info, settings, args),
    )
    holder.append(server)
    _exit_zero_on_signals()
    load_failure = serve_when_engine_ready(server, engine)
    if load_failure is not None:
        print(f"detinf serve: error: the engine failed to start: {load_failure}", file=sys.stderr)
        return 1
    if not server.started:  # a signal while the engine was being built: nothing was served
        return 0
    return 1 if failures or not app.state.stopped_cleanly else 0


def _print_ready(info: EngineInfo | None, settings: ServerSettings, args: argparse.Namespace) -> None:
    """The one line saying the server accepts requests (after uvicorn bound the port)."""
    if info is None:  # pragma: no cover - the port is bound only once the engine is ready
        return
    print(
        f"detinf serve: ready: model {settings.served_model_name or info.model_name}, "
        f"system_fingerprint {info.system_fingerprint}, http://{args.host}:{args.port}",
        file=sys.stderr,
        flush=True,
    )


def _run_replicated(args: argparse.Namespace, config: Any, settings: Any) -> int:
    """`serve --replicas N`: the Ray Serve deployment (imports Ray only here)."""
    from deterministic_inference.errors import ConfigError

    replicas = 1 if args.replicas is None else args.replicas
    if replicas < 1:
        raise ConfigError(f"--replicas: {replicas} must be >= 1")
    if config.model is not None and not os.path.exists(config.model):
        raise ConfigError(f"--model: {config.model} does not exist; give a GGUF file or an HF directory")
    from deterministic_inference.scaleout.serve_app import ReplicatedSpec, run_replicated

    spec = ReplicatedSpec(
        replicas=replicas,
        engine=config,
        settings=settings,
        expected_system_fingerprint=args.expect_fingerprint,
        cpus_per_replica=float(config.threads or 1),
    )
    return run_replicated(spec, args.host, args.port, args.ray_address)


def _exit_zero_on_signals() -> None:
    """uvicorn shuts down on SIGTERM/SIGINT, then re-raises the signal to the previous handler; make that
    handler a no-op so a clean shutdown exits with our code instead of dying by the signal."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: None)
