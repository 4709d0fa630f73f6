"""``detinf serve --config MANIFEST``: serve what a manifest pins.

The serve command (registered by the server commands) gets ``--config`` / ``--lock`` and, for manifests
whose ``runtime.execution.backend`` is ``vllm`` or ``sglang``, the GPU-engine options ``--image``,
``--pull``, ``--dry-run`` and ``--compose-file`` (`workflow/gpu_serve`, untested on GPU). Embedded and
openai_compatible manifests are served by this process's own engine (`workflow/serve_config`).
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def extend_serve(subparsers: Any) -> None:
    """Add the manifest options to `detinf serve` and wrap its command."""
    serve = getattr(subparsers, "choices", {}).get("serve")
    if serve is None:
        return
    serve.add_argument("--config", type=Path, default=None,
                       help="serve what this manifest pins (checks its lock and artifact digests first)")
    serve.add_argument("--lock", type=Path, default=None, help="lock of --config (default: next to it)")
    gpu = serve.add_argument_group("GPU engines (manifest backend vllm or sglang; untested on GPU)")
    gpu.add_argument("--image", default=None,
                     help="engine image NAME@sha256:<digest> (before runtime.execution.vllm_image / "
                     "sglang_image and $VLLM_IMAGE / $SGLANG_IMAGE)")
    gpu.add_argument("--pull", action="store_true", help="docker pull the pinned image before starting")
    gpu.add_argument("--dry-run", action="store_true",
                     help="write and print the compose file, start nothing")
    gpu.add_argument("--compose-file", type=Path, default=None,
                     help="where the compose file is written (default: <manifest>.compose.yaml beside it)")
    original = serve.get_default("func")
    # with --config, host and port left at these defaults come from runtime.execution.base_url
    listen = {"host": serve.get_default("host"), "port": serve.get_default("port")}

    def serve_with_config(args: argparse.Namespace) -> int:
        if args.config is None:
            _refuse_gpu_options(args, "without --config")
            return int(original(args))
        from deterministic_inference.workflow.manifest import GPU_BACKENDS, load_manifest
        from deterministic_inference.workflow.network import offline_guard
        from deterministic_inference.workflow.serve_config import apply_manifest

        backend = load_manifest(args.config).data["runtime"]["execution"]["backend"]
        if backend in GPU_BACKENDS:
            return serve_gpu(args)
        _refuse_gpu_options(args, f"with backend {backend!r}")
        policy, env = apply_manifest(args, listen)
        with _process_env(env), offline_guard() if policy == "offline_required" else contextlib.nullcontext():
            return int(original(args))

    serve.set_defaults(func=serve_with_config)


def serve_gpu(args: argparse.Namespace) -> int:
    """Check the manifest and its lock as `detinf run` does, then start (or, with --dry-run, only write)
    the GPU engine's compose file."""
    from deterministic_inference.errors import WorkflowError
    from deterministic_inference.workflow import gpu_serve
    from deterministic_inference.workflow.manifest import load_manifest
    from deterministic_inference.workflow.run import RunOptions, prepare

    for option in ("model", "model_file", "api_key"):
        if getattr(args, option, None):
            raise WorkflowError(f"--{option.replace('_', '-')}: not used with a GPU backend manifest (the "
                                "manifest pins the model; the engine is reached without a key); remove it")
    manifest = load_manifest(args.config)
    for warning in manifest.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    prepare(manifest, RunOptions(lock_path=args.lock), sys.stderr)
    plan = gpu_serve.build_plan(manifest, args.image, args.served_model_name)
    stem = manifest.default_lock_path().name.removesuffix(".lock.json")
    compose_path = args.compose_file or manifest.path.with_name(f"{stem}.compose.yaml")
    command_line = "detinf serve --config " + shlex.quote(str(args.config))
    if args.dry_run:
        compose_path.parent.mkdir(parents=True, exist_ok=True)
        compose_path.write_text(plan.compose_text(command_line), encoding="utf-8")
        sys.stdout.write(plan.compose_text(command_line))
        print(f"wrote {compose_path} (image from {plan.image_source}; not started: --dry-run)",
              file=sys.stderr)
        return 0
    gpu_serve.start(plan, compose_path, args.pull, command_line)
    print(f"started {plan.engine} ({plan.image}) as {plan.project}; it serves {plan.base_url} once loaded "
          f"(`detinf run --config {args.config}` and `detinf audit --base-url {plan.base_url}` reach it)",
          file=sys.stderr)
    return 0


def _refuse_gpu_options(args: argparse.Namespace, context: str) -> None:
    from deterministic_inference.errors import WorkflowError

    for name in ("image", "pull", "dry_run", "compose_file"):
        if getattr(args, name):
            raise WorkflowError(f"--{name.replace('_', '-')}: only for manifests whose "
                                f"runtime.execution.backend is vllm or sglang, not {context}; remove it")


@contextlib.contextmanager
def _process_env(env: dict[str, str]) -> Iterator[None]:
    from deterministic_inference.workflow.run import applied_env

    with applied_env(env):
        yield
