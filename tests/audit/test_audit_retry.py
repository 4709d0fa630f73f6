"""`detinf audit` through an endpoint that fails (503, 429, dropped answers, a restart): the failures
are retried, listed in the report, and the audit still passes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deterministic_inference.cli.main import main
from tests.server.harness import RunningServer
from tests.workflow.flaky_endpoint import flaky_endpoint

SCRIPT = ["503", "drop", "429", "restart", "forward", "503"]
SMALL = ["--n-trials", "2", "--concurrency", "3", "--requests", "6", "--max-tokens", "4", "--seeds", "2"]


def test_audit_retries_a_failing_endpoint(invariant_server: RunningServer, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    report_path = tmp_path / "single.json"
    with flaky_endpoint(invariant_server.base_url, SCRIPT) as endpoint:
        code = main(["audit", "--base-url", endpoint.base_url, "--mode", "single", *SMALL,
                     "--json", str(report_path)])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    report = json.loads(report_path.read_text())
    assert report["passed"] is True
    reasons = [event["reason"] for event in report["retries"]]
    assert reasons.count("HTTP 503") == 2 and reasons.count("HTTP 429") == 1
    assert sum(reason.startswith("RemoteProtocolError") for reason in reasons) == 2
    assert captured.err.count("retry: POST ") == len(reasons)


def test_audit_without_failures_reports_no_retries(invariant_server: RunningServer, tmp_path: Path) -> None:
    report_path = tmp_path / "single.json"
    code = main(["audit", "--base-url", invariant_server.base_url, "--mode", "single", *SMALL,
                 "--json", str(report_path)])
    assert code == 0 and json.loads(report_path.read_text())["retries"] == []
