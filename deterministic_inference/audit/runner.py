"""Run audit modes against an endpoint and build the report (printed lines + JSON document)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

from deterministic_inference.audit.client import AuditClient, Endpoint
from deterministic_inference.audit.modes import AuditSettings, Case, describe, run_mode
from deterministic_inference.workflow.progress import Progress

REPORT_FORMAT = "detinf-audit/1"


async def audit(
    endpoint: Endpoint, modes: Sequence[str], settings: AuditSettings, out: TextIO | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Run `modes` in order; print one summary line per case to `out` (and requests answered so far to
    `progress`); return the JSON report."""
    cases: list[Case] = []
    started = time.monotonic()
    concurrency = max(settings.concurrency, settings.seeds, 8)
    async with AuditClient(endpoint, concurrency) as client:
        client.progress = progress
        for mode in modes:
            for case in await run_mode(mode, client, settings):
                cases.append(case)
                if out is not None:
                    print(summary_line(case), file=out, flush=True)
        model = client.model
        retries = client.retries.events
    return {
        "format": REPORT_FORMAT,
        "base_url": endpoint.base_url,
        "endpoint": "chat" if endpoint.chat else "completions",
        "model": model,
        "modes": list(modes),
        "settings": asdict(settings),
        "compare_logprobs": endpoint.logprobs,
        "seconds": round(time.monotonic() - started, 3),
        "passed": all(case.passed for case in cases),
        "retries": retries,
        "cases": [describe(case) for case in cases],
    }


def run(
    endpoint: Endpoint, modes: Sequence[str], settings: AuditSettings, out: TextIO | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Synchronous wrapper of `audit` (its own event loop)."""
    try:
        return asyncio.run(audit(endpoint, modes, settings, out, progress))
    finally:
        if progress is not None:
            progress.close()


def summary_line(case: Case) -> str:
    """`<name>: Total samples: X, Unique samples: Y  [PASS|FAIL]`."""
    verdict = "PASS" if case.passed else "FAIL"
    expectation = "" if case.expect_identical else " (must be > 1)"
    notes = f"  ({'; '.join(case.notes)})" if case.notes else ""
    return (
        f"{case.name}: Total samples: {len(case.samples)}, Unique samples: {case.unique}{expectation}  "
        f"[{verdict}]{notes}"
    )


def write_report(report: dict[str, Any], path: Path) -> None:
    """Deterministic JSON (sorted keys, 2-space indent, trailing newline)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
