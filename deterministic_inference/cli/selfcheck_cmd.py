"""`detinf selfcheck`: run the start-up batch-invariance probes for a model on this machine and print them."""

from __future__ import annotations

import argparse
import json
from typing import Any

from deterministic_inference.cli.options import add_model_file_option, model_path_from_args
from deterministic_inference.config import DTYPES, NUMERICS_MODES, QUANTIZATIONS, EngineConfig


def register(subparsers: Any) -> None:
    """Adds `selfcheck`."""
    parser = subparsers.add_parser(
        "selfcheck", help="probe batch invariance of every op at a model's shapes on this machine"
    )
    parser.add_argument(
        "--model", default=None,
        help="GGUF file, HF directory, or a directory of GGUF files with --model-file (default: embedded "
        "SmolLM2-135M)",
    )
    add_model_file_option(parser)
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help="weights/activations dtype")
    parser.add_argument(
        "--quantization", default="auto", choices=QUANTIZATIONS, help="weight formats (as for generate)"
    )
    parser.add_argument(
        "--numerics", default="portable", metavar="{" + ",".join(NUMERICS_MODES) + "}",
        help="portable, or native: probe the AMX-BF16 GEMM (as for generate)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.set_defaults(func=run_selfcheck_command)


def run_selfcheck_command(args: argparse.Namespace) -> int:
    """Exit 0 when every probe is bitwise equal, 1 when one differs (the table names it). The model is
    built as the engine builds it, so its own linears (every weight format it uses) are probed."""
    from deterministic_inference.engine.setup import build_model, resolve_dtype
    from deterministic_inference.model.loader import load_model
    from deterministic_inference.ops.selfcheck import run_selfcheck

    config = EngineConfig(  # validates
        model=model_path_from_args(args.model, args.model_file), dtype=args.dtype,
        quantization=args.quantization, threads=args.threads, numerics_mode=args.numerics,
    )
    loaded = load_model(config.model, config.quantization)
    model = build_model(loaded, config, resolve_dtype(config.dtype, config.batch_invariant), 4096)
    report = run_selfcheck(
        loaded.spec, model.numerics, config.threads, model.probe_linears(), model.probe_blocks()
    )
    if args.json:
        print(json.dumps(report.to_dict(), sort_keys=True))
    else:
        print(report.table())
    return 0 if report.ok else 1
