"""``detinf serve --config MANIFEST``: serve what a manifest pins.

The manifest and its lock go through the same checks as ``detinf run`` (lock integrity and ownership,
hardware constraints, dataset and model-file digests, closure), then the serve command's engine options
are set from the manifest. Numerics the serve options cannot express (tile and KV-block sizes other than
the engine defaults) are refused rather than served differently. With --host / --port at their defaults the
server listens where ``runtime.execution.base_url`` points (the address `detinf run --config` sends to).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any
from urllib.parse import urlsplit

from deterministic_inference.config import EngineConfig
from deterministic_inference.errors import WorkflowError
from deterministic_inference.workflow.manifest import load_manifest
from deterministic_inference.workflow.run import RunOptions, prepare

_FIXED_NUMERICS = ("linear_tile_rows", "kv_block_size")


def apply_manifest(args: argparse.Namespace, listen_defaults: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """Check the manifest and set the serve options from it (--host / --port still at `listen_defaults`
    from runtime.execution.base_url); returns (network policy, runtime env)."""
    for option in ("model", "model_file"):
        if getattr(args, option, None) is not None:
            flag = "--" + option.replace("_", "-")
            raise WorkflowError(f"{flag}: give either --config or {flag}, not both (the manifest pins the "
                                "model: model.source)")
    manifest = load_manifest(args.config)
    for warning in manifest.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    data = manifest.data
    if data["model"]["source"]["type"] == "remote":
        raise WorkflowError(
            f"{manifest.path}: $.model.source: a remote model cannot be served here; "
            "point model.source at a local model"
        )
    prepared = prepare(manifest, RunOptions(lock_path=args.lock), sys.stderr)
    engine, batching = data["engine"], data["inference"]["batching"]
    defaults = EngineConfig()
    for name in _FIXED_NUMERICS:
        if engine[name] != getattr(defaults, name):
            raise WorkflowError(
                f"{manifest.path}: $.engine.{name}: {engine[name]} differs from the engine "
                f"default {getattr(defaults, name)}, which `detinf serve` cannot change; "
                "use the default or run the manifest with `detinf run`"
            )
    path = prepared.location.engine_path
    settings: dict[str, Any] = {
        "model": str(path) if path is not None else None,
        "dtype": engine["dtype"],
        "no_batch_invariant": not engine["batch_invariant"],
        "no_prefix_cache": not batching["enable_prefix_caching"],
        "max_num_seqs": batching["max_num_seqs"],
        "max_num_batched_tokens": batching["max_num_batched_tokens"],
        "max_model_len": engine["max_model_len"],
        "num_kv_blocks": engine["num_kv_blocks"],
        "kv_cache_memory": engine["kv_cache_memory"],
        "quantization": engine["quantization"],
        "kv_cache_dtype": engine.get("kv_cache_dtype", "auto"),
        "numerics": engine.get("numerics", "portable"),
        "threads": data["runtime"]["threads"],
        "default_seed": engine["seed"],
        "no_selfcheck": not engine["selfcheck"],
        "speculative_config": _speculative_json(engine.get("speculative_config")),
    }
    for name, value in settings.items():
        setattr(args, name, value)
    source = data["model"]["source"]
    if args.served_model_name is None:  # the name `detinf run` asks for (else it takes the served one)
        args.served_model_name = data["runtime"]["execution"]["model"] or source.get("repo")
    _listen_from_base_url(args, data["runtime"]["execution"]["base_url"], listen_defaults)
    return str(data["runtime"]["network_policy"]), dict(data["runtime"]["env"])


def _listen_from_base_url(args: argparse.Namespace, base_url: str | None, defaults: dict[str, Any]) -> None:
    """--host / --port at their defaults: listen where the manifest's runtime.execution.base_url points,
    so `detinf run --config` (which sends its requests there) reaches this server."""
    if not base_url:
        return
    parts = urlsplit(base_url)
    try:
        port = parts.port
    except ValueError:
        raise WorkflowError(f"$.runtime.execution.base_url: {base_url!r} has a bad port; "
                            "write a URL like http://127.0.0.1:8000") from None
    if args.host == defaults["host"] and parts.hostname:
        args.host = parts.hostname
    if args.port == defaults["port"] and port is not None:
        args.port = port


def _speculative_json(value: dict[str, Any] | None) -> str | None:
    """engine.speculative_config as the --speculative-config text `serve` parses."""
    return None if value is None else json.dumps(value, sort_keys=True)
