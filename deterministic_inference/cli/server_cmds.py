"""`detinf serve` (OpenAI-compatible server) and `detinf audit` (determinism audit of any endpoint)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any

from deterministic_inference.cli.options import add_engine_options, engine_config_from_args

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
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    add_engine_options(parser)
    parser.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Runs uvicorn until SIGINT/SIGTERM (in-flight requests finish first); 1 if the engine failed to load."""
    import uvicorn

    from deterministic_inference.engine.async_engine import EngineInfo
    from deterministic_inference.server.app import DEFAULT_MAX_WAITING, ServerSettings, create_app

    config = engine_config_from_args(args)
    if args.max_waiting is not None and args.max_waiting < 0:
        print("detinf serve: error: --max-waiting must be >= 0", file=sys.stderr)
        return 2
    settings = ServerSettings(
        api_key=args.api_key or os.environ.get("DETINF_API_KEY") or None,
        served_model_name=args.served_model_name,
        max_waiting=DEFAULT_MAX_WAITING if args.max_waiting is None else args.max_waiting,
    )
    failures: list[str] = []
    holder: list[uvicorn.Server] = []

    def on_load_failure(summary: str) -> None:
        failures.append(summary)
        print(f"detinf serve: error: the engine failed to start: {summary}", file=sys.stderr)
        holder[0].should_exit = True

    def on_ready(info: EngineInfo) -> None:
        print(
            f"detinf serve: ready: model {settings.served_model_name or info.model_name}, "
            f"system_fingerprint {info.system_fingerprint}, http://{args.host}:{args.port}",
            file=sys.stderr,
            flush=True,
        )

    app = create_app(config, settings, on_load_failure=on_load_failure, on_ready=on_ready)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    holder.append(server)
    _exit_zero_on_sigterm()
    server.run()
    return 1 if failures else 0


def _exit_zero_on_sigterm() -> None:
    """uvicorn drains on SIGTERM, then re-raises the signal to the previous handler; make that handler a
    no-op so a drained shutdown exits 0 instead of dying by the signal."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
