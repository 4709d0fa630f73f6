"""`detinf audit`: determinism audit of any OpenAI-compatible endpoint.

Exit code 0 when every case passed, 1 when a case had more than one unique output (or different
seeds gave the same output), 2 when the audit could not run.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from deterministic_inference.audit import MODES


def register_audit(subparsers: Any) -> None:
    """Adds `audit`."""
    parser = subparsers.add_parser("audit", help="audit an OpenAI-compatible endpoint for determinism")
    parser.add_argument("--base-url", required=True, help="http://host:port or http://host:port/v1")
    parser.add_argument("--api-key", default=None, help="Bearer token (default: $DETINF_API_KEY)")
    parser.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    parser.add_argument(
        "--mode", required=True, choices=(*MODES, "all"), help="what to vary ('all': every mode)"
    )
    parser.add_argument("--n-trials", type=int, default=3, help="rounds per case (default 3)")
    parser.add_argument("--concurrency", type=int, default=10, help="requests in flight (default 10)")
    parser.add_argument(
        "--requests", type=int, default=100, help="requests of the concurrency mode (default 100)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=16, help="tokens generated per request (default 16)"
    )
    parser.add_argument("--seeds", type=int, default=4, help="seeds of the sampling mode (default 4)")
    parser.add_argument("--temperature", type=float, default=0.8, help="temperature of the sampling mode")
    parser.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=1024,
        help="longest shared prefix in prefix/radix (default 1024)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the audit's random prompts")
    parser.add_argument(
        "--chat", action="store_true", help="use /v1/chat/completions instead of /v1/completions"
    )
    parser.add_argument(
        "--no-logprobs", action="store_true", help="compare text only (servers without logprobs)"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    parser.add_argument("--json", type=Path, default=None, help="write the JSON report here")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress on stderr (requests answered, tokens/s)")
    parser.set_defaults(func=run_audit)


def run_audit(args: argparse.Namespace) -> int:
    """Runs the audit, prints one line per case, writes the report; exit code per the module doc."""
    from deterministic_inference.audit.client import AuditError, Endpoint
    from deterministic_inference.audit.modes import AuditSettings
    from deterministic_inference.audit.runner import run, write_report

    for name in ("n_trials", "concurrency", "requests", "max_tokens", "seeds", "max_prompt_tokens"):
        if getattr(args, name) < 1:
            raise AuditError(f"--{name.replace('_', '-')} must be >= 1")
    endpoint = Endpoint(
        base_url=args.base_url,
        api_key=args.api_key or os.environ.get("DETINF_API_KEY") or None,
        model=args.model,
        chat=args.chat,
        logprobs=not args.no_logprobs,
        timeout=args.timeout,
    )
    settings = AuditSettings(
        n_trials=args.n_trials,
        concurrency=args.concurrency,
        requests=args.requests,
        max_tokens=args.max_tokens,
        seeds=args.seeds,
        temperature=args.temperature,
        seed=args.seed,
        max_prompt_tokens=args.max_prompt_tokens,
    )
    modes = list(MODES) if args.mode == "all" else [args.mode]
    from deterministic_inference.workflow.progress import Progress

    progress = Progress("audit", None, sys.stderr, enabled=not args.quiet)
    report = run(endpoint, modes, settings, sys.stdout, progress)
    if args.json is not None:
        write_report(report, args.json)
    verdict = "PASSED" if report["passed"] else "FAILED"
    print(f"audit {verdict}: {sum(c['passed'] for c in report['cases'])}/{len(report['cases'])} cases passed")
    return 0 if report["passed"] else 1
