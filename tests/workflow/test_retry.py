"""`detinf run --base-url` against an endpoint that fails (503, 429, answers dropped, one restart): the
failures are retried, every retry is logged, no answered request is sent again, and the run directory
equals a clean run's; a fingerprint that changes across a restart stops the run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deterministic_inference.errors import WorkflowError
from deterministic_inference.server.app import ServerSettings
from deterministic_inference.workflow.retry import RetryLog, RetryPolicy, send_with_retries
from tests.server.harness import RunningServer, thread_server, tiny_config
from tests.tiny_models import TinyModel
from tests.workflow.flaky_endpoint import flaky_endpoint
from tests.workflow.helpers import detinf, edit_manifest, read_json

SCRIPT = ["503", "drop", "429", "restart", "forward", "503", "503"]


@pytest.fixture(scope="module")
def server(tiny_llama_dir: TinyModel) -> Iterator[RunningServer]:
    """A real server on the tiny model."""
    with thread_server(tiny_config(tiny_llama_dir), ServerSettings(served_model_name="tiny")) as running:
        yield running


@pytest.fixture()
def remote_manifest(tiny_manifest: Path) -> Path:
    """The tiny manifest with 4 prompts, two in flight at a time."""
    edit_manifest(tiny_manifest, {"inference": {"n_prompts": 4, "batching": {"concurrency": 2}}})
    assert detinf("lock", "--config", tiny_manifest).code == 0
    return tiny_manifest


def test_failing_endpoint_is_retried_to_the_clean_run(remote_manifest: Path, server: RunningServer,
                                                     tmp_path: Path) -> None:
    clean = detinf("run", "--config", remote_manifest, "--base-url", server.base_url,
                   "--output-dir", tmp_path / "clean")
    assert clean.code == 0, clean.err
    with flaky_endpoint(server.base_url, SCRIPT) as endpoint:
        flaky = detinf("run", "--config", remote_manifest, "--base-url", endpoint.base_url,
                       "--output-dir", tmp_path / "flaky")
    assert flaky.code == 0, flaky.err
    assert sorted(endpoint.delivered.values()) == [1, 1, 1, 1]  # each answer arrived once, never re-sent
    assert endpoint.forwarded == 4 + 2  # the two dropped answers were computed, then asked for again
    for name in ("tokens.json", "requests.json", "captures/logits.json"):
        assert (tmp_path / "flaky" / name).read_bytes() == (tmp_path / "clean" / name).read_bytes(), name
    retries = read_json(tmp_path / "flaky" / "run_log.json")["retries"]
    reasons = [event["reason"] for event in retries]
    assert reasons.count("HTTP 503") == 3 and reasons.count("HTTP 429") == 1
    assert sum(reason.startswith("RemoteProtocolError") for reason in reasons) == 2
    assert any(reason.startswith("ConnectError") for reason in reasons)  # while it restarted
    assert flaky.err.count("retry: req-") == len(retries)
    assert read_json(tmp_path / "clean" / "run_log.json")["retries"] == []
    graded = detinf("verify", "--bundle-a", tmp_path / "clean", "--bundle-b", tmp_path / "flaky",
                    "--output-dir", tmp_path / "report")
    assert graded.code == 0 and "conformant" in graded.out


def test_a_fingerprint_changed_by_a_restart_stops_the_run(remote_manifest: Path, server: RunningServer,
                                                          tmp_path: Path) -> None:
    with flaky_endpoint(server.base_url, ["restart"], rewrite_fingerprint_after_restart=True) as endpoint:
        result = detinf("run", "--config", remote_manifest, "--base-url", endpoint.base_url,
                        "--output-dir", tmp_path / "mixed")
    assert result.code == 2 and "system_fingerprint changed during the run" in result.err
    assert "detinf-0000000000000000" in result.err and not (tmp_path / "mixed").exists()


def test_backoff_is_exponential_bounded_and_gives_up() -> None:
    policy = RetryPolicy(attempts=4, base_seconds=0.5, cap_seconds=1.5)
    assert [policy.delay(n, None) for n in (1, 2, 3, 4)] == [0.5, 1.0, 1.5, 1.5]
    assert policy.delay(1, 30.0) == 1.5 and policy.delay(1, 0.0) == 0.0
    waits: list[float] = []
    request = httpx.Request("POST", "http://127.0.0.1:9/v1/completions")
    log = RetryLog()
    with pytest.raises(WorkflowError, match="request r1 failed 4 times, last: HTTP 503"):
        send_with_retries(lambda: httpx.Response(503, request=request), "r1", policy, log, "here",
                          waits.append)
    assert waits == [0.5, 1.0, 1.5] and [event["attempt"] for event in log.events] == [1, 2, 3]
    answered = send_with_retries(lambda: httpx.Response(400, request=request), "r2", policy, log, "here",
                                 waits.append)
    assert answered.status_code == 400 and len(waits) == 3  # an answer is final, never re-sent


def test_negative_control_without_retries_the_same_endpoint_fails_the_run(
    remote_manifest: Path, server: RunningServer
) -> None:
    import io

    from deterministic_inference.workflow.backend_http import run_http
    from deterministic_inference.workflow.manifest import load_manifest
    from deterministic_inference.workflow.run import RunOptions, prepare

    prepared = prepare(load_manifest(remote_manifest), RunOptions(), io.StringIO())
    with flaky_endpoint(server.base_url, SCRIPT) as endpoint, \
            pytest.raises(WorkflowError, match="failed 1 times, last: (HTTP 503|HTTP 429|Remote)"):
        run_http(prepared.manifest.data, endpoint.base_url, prepared.requests, policy=RetryPolicy(attempts=1))


@pytest.mark.parametrize(("hook", "done"), [("2:after_fsync", 2), ("3:mid_record", 2)])
def test_a_killed_endpoint_run_resumes_without_asking_again(remote_manifest: Path, server: RunningServer,
                                                            tmp_path: Path, hook: str, done: int) -> None:
    """Answers are kept as they arrive; a SIGKILLed run resumed asks only for the missing ones and
    writes the clean run's bytes."""
    import os
    import signal
    import subprocess
    import sys

    from deterministic_inference.workflow import checkpoint

    clean = detinf("run", "--config", remote_manifest, "--base-url", server.base_url,
                   "--output-dir", tmp_path / "clean")
    assert clean.code == 0, clean.err
    target = tmp_path / "killed"
    root = Path(__file__).resolve().parents[2]
    killed = subprocess.run(
        [sys.executable, "-m", "deterministic_inference", "run", "--config", str(remote_manifest),
         "--base-url", server.base_url, "--output-dir", str(target)],
        env={**os.environ, "PYTHONPATH": str(root), checkpoint.TEST_KILL_HOOK: hook},
        capture_output=True, text=True, timeout=600, cwd=root)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    with flaky_endpoint(server.base_url, []) as endpoint:
        resumed = detinf("run", "--config", remote_manifest, "--base-url", endpoint.base_url,
                         "--output-dir", target, "--resume")
    assert resumed.code == 0, resumed.err
    assert f"{done}/4 requests done" in resumed.err
    assert sum(endpoint.delivered.values()) == 4 - done  # only the missing answers were asked for
    for name in ("tokens.json", "requests.json", "captures/logits.json"):
        assert (target / name).read_bytes() == (tmp_path / "clean" / name).read_bytes(), name
    (event,) = read_json(target / "run_log.json")["checkpoint"]["resumes"]
    assert event["requests_done"] == done
