"""`detinf audit` against real servers: every mode passes on ours; the negative control (batch
invariance off) reports more than one unique output."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from deterministic_inference.audit import MODES
from deterministic_inference.audit.client import Sample, completion_sample
from deterministic_inference.cli.main import main
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.faults import FaultInjection
from deterministic_inference.server.app import ServerSettings
from tests.server.harness import TINY_NAME, RunningServer, thread_server, tiny_config
from tests.tiny_models import TinyModel

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
    """Without batch invariance, the same seed's requests compute different bits in batches of different
    sizes (9 requests at concurrency 4: batches of 4, 4 and 1 rows; with 6 requests at concurrency 6 every
    trial shared one batch and an Intel CPU's torch GEMMs gave the same bits)."""
    code, report = audit(plain_server, "sampling", tmp_path, "--n-trials", "3", "--concurrency", "4")
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


def test_p_vs_d_negative_control_plain_ops(plain_server: RunningServer, tmp_path: Path) -> None:
    """Plain ops: a decoded token's logprob differs from the same token's prompt logprob somewhere."""
    code, report = audit(plain_server, "p_vs_d", tmp_path, "--max-tokens", "16")
    assert code == 1
    assert any(case["unique_samples"] > 1 for case in report["cases"])  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("removed", "resets"),
    [(("/flush_cache",), True), (("/flush_cache", "/reset_prefix_cache"), False)],
)
def test_audit_resets_the_cache_through_whichever_endpoint_exists(
    tiny_llama_dir: TinyModel, tmp_path: Path, removed: tuple[str, ...], resets: bool
) -> None:
    """A vLLM-like server (only /reset_prefix_cache) is reset through it; with neither, the audit says so."""
    with thread_server(tiny_config(tiny_llama_dir), ServerSettings(served_model_name=TINY_NAME),
                       without_paths=removed) as server:
        assert httpx.post(server.base_url + "/flush_cache").status_code == 404
        code, report = audit(server, "radix", tmp_path)
    assert code == 0
    notes = [note for case in report["cases"] for note in case["notes"]]  # type: ignore[attr-defined]
    assert any("has no /flush_cache or /reset_prefix_cache" in note for note in notes) is not resets


def test_negative_control_structured_mode_sees_masks_from_another_row(
    tiny_llama_dir: TinyModel, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A server that samples each constrained row with the next constrained row's mask (a test-only
    fault): the structured mode must not pass. Either a target's outputs changed with its company (exit
    1), or a row's token broke its own grammar and the request failed (exit 2, naming the grammar)."""
    config = tiny_config(tiny_llama_dir)

    def engine_factory() -> Engine:
        return Engine(config, faults=FaultInjection(rotate_grammar_masks=True))

    report = tmp_path / "structured.json"
    settings = ServerSettings(served_model_name=TINY_NAME)
    with thread_server(config, settings, engine_factory=engine_factory) as server:
        code = main(["audit", "--base-url", server.base_url, "--mode", "structured", *SMALL,
                     "--max-tokens", "12", "--json", str(report)])  # fmt: skip
    captured = capsys.readouterr()
    if code == 1:
        cases = json.loads(report.read_text())["cases"]
        assert any(case["unique_samples"] > 1 for case in cases)
    else:
        assert code == 2 and "grammar" in captured.err, captured.err
