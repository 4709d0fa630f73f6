"""`detinf audit` against real servers: every mode passes on ours; the negative control (batch
invariance off) reports more than one unique output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deterministic_inference.audit.client import Sample, completion_sample
from deterministic_inference.audit.modes import MODES
from deterministic_inference.cli.main import main
from tests.server.harness import RunningServer

SMALL = ["--n-trials", "2", "--concurrency", "6", "--requests", "12", "--max-tokens", "4", "--seeds", "3"]


def audit(server: RunningServer, mode: str, tmp_path: Path, *extra: str) -> tuple[int, dict[str, object]]:
    report = tmp_path / f"{mode}.json"
    code = main(
        ["audit", "--base-url", server.base_url, "--mode", mode, *SMALL, *extra, "--json", str(report)]
    )
    return code, json.loads(report.read_text())


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_passes_against_our_server(
    invariant_server: RunningServer, mode: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = audit(invariant_server, mode, tmp_path)
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert report["passed"] is True and report["format"] == "detinf-audit/1"
    assert "Total samples: " in printed and "Unique samples: 1" in printed
    for case in report["cases"]:  # type: ignore[attr-defined]
        assert case["total_samples"] >= 2


def test_chat_endpoint_and_v1_base_url(invariant_server: RunningServer, tmp_path: Path) -> None:
    report = tmp_path / "chat.json"
    code = main(
        [
            "audit",
            "--base-url",
            invariant_server.v1,
            "--mode",
            "mixed",
            "--chat",
            *SMALL,
            "--json",
            str(report),
        ]
    )
    assert code == 0
    assert json.loads(report.read_text())["endpoint"] == "chat"


def test_negative_control_reports_more_than_one_unique_output(
    plain_server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without batch invariance, a cold prefill and a prefix-cache hit compute different bits."""
    code, report = audit(plain_server, "sampling", tmp_path)
    assert code == 1, capsys.readouterr().out
    identical_cases = [c for c in report["cases"] if c["expect_identical"]]  # type: ignore[attr-defined]
    assert any(case["unique_samples"] > 1 for case in identical_cases)


def test_unreachable_server_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["audit", "--base-url", "http://127.0.0.1:9", "--mode", "single", "--timeout", "5"])
    assert code == 2
    assert "cannot reach" in capsys.readouterr().err


def test_samples_compare_logprob_bits() -> None:
    def response(logprob: float) -> dict[str, object]:
        return {
            "choices": [
                {
                    "text": "a",
                    "finish_reason": "length",
                    "logprobs": {
                        "tokens": ["a"],
                        "token_logprobs": [logprob],
                        "top_logprobs": [{"a": logprob}],
                    },
                }
            ]
        }

    same = completion_sample(response(-0.5), echoed=False)
    assert same.digest == completion_sample(response(-0.5), echoed=False).digest
    next_float = float.fromhex("-0x1.0000000000001p-1")
    assert same.digest != completion_sample(response(next_float), echoed=False).digest
    assert Sample("a", "stop").digest != Sample("a", "length").digest
