"""`detinf run --ray-address ADDR --shards 2` writes the one-process run directory's outputs.

The runs use the local Ray instance of the package (`ray_cluster`) through its address, from a separate
`detinf` process like a user's. One one-process run of the same manifest is the reference.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.server.harness import detinf_command
from tests.tiny_models import TinyModel
from tests.workflow.helpers import detinf, edit_manifest, read_json

pytestmark = pytest.mark.slow
SHARD_LINE = re.compile(r"shard (\d+)/(\d+): (\d+) request\(s\) on worker pid (\d+) .* attempt (\d+)")


@pytest.fixture(scope="module")
def sharded_manifest(tiny_llama_dir: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A locked manifest on the tiny model: 6 prompts, 24 tokens each, logits and activations captured."""
    root = tmp_path_factory.mktemp("sharded")
    path = root / "m.json"
    model = tiny_llama_dir.path
    created = detinf("init", "--output", path, "--model", model, "--n-prompts", "6", "--max-tokens", "24")
    assert created.code == 0, created.err
    edit_manifest(path, {"engine": {"num_kv_blocks": 256},
                         "capture": {"activations": {"enabled": True}, "logits": {"enabled": True}}})
    assert detinf("lock", "--config", path).code == 0
    return path


@pytest.fixture(scope="module")
def one_process_run(sharded_manifest: Path) -> Path:
    target = sharded_manifest.parent / "one-process"
    result = detinf("run", "--config", sharded_manifest, "--output-dir", target)
    assert result.code == 0, result.err
    return target


def _sharded(manifest: Path, target: Path, address: str, kill_attempts: dict[int, int]
             ) -> tuple[int, str]:
    """`detinf run --ray-address ADDR --shards 2` in a subprocess; SIGKILL the worker of shard i at its
    attempts listed in `kill_attempts` (shard -> how many attempts to kill) as soon as it is announced."""
    command = [*detinf_command(), "run", "--config", str(manifest), "--output-dir", str(target),
               "--ray-address", address, "--shards", "2"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               cwd=Path(__file__).resolve().parents[2])
    lines = []
    deadline = time.monotonic() + 600
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line)
        match = SHARD_LINE.search(line)
        if match and int(match.group(5)) <= kill_attempts.get(int(match.group(1)), 0):
            os.kill(int(match.group(4)), signal.SIGKILL)
        if time.monotonic() > deadline:
            process.kill()
            break
    return process.wait(timeout=60), "".join(lines)


def _check_conformant(reference: Path, sharded: Path, report_dir: Path) -> None:
    result = detinf("verify", "--bundle-a", reference, "--bundle-b", sharded, "--output-dir", report_dir)
    assert result.code == 0 and "grade: conformant" in result.out, result.out + result.err
    for name in ("tokens.json", "captures/logits.json", "captures/activations.json", "requests.json"):
        assert (reference / name).read_bytes() == (sharded / name).read_bytes(), name
    bundle_a, bundle_b = read_json(reference / "bundle.json"), read_json(sharded / "bundle.json")
    assert bundle_a["run_id"] == bundle_b["run_id"] and bundle_a["fingerprint"] == bundle_b["fingerprint"]


def test_sharded_run_equals_one_process(sharded_manifest: Path, one_process_run: Path, ray_cluster: str,
                                        tmp_path: Path) -> None:
    code, output = _sharded(sharded_manifest, tmp_path / "sharded", ray_cluster, {})
    assert code == 0, output
    assert "capture.engine_trace: not written for a sharded run" in output  # the manifest captures it
    assert json.loads(sharded_manifest.read_text())["capture"]["engine_trace"]["enabled"]
    _check_conformant(one_process_run, tmp_path / "sharded", tmp_path / "report")
    shards = read_json(tmp_path / "sharded" / "run_log.json")["shards"]
    assert [s["num_requests"] for s in shards] == [3, 3]
    for shard in shards:
        assert shard["hardware"]["isa"] and shard["hardware_digest"].startswith("sha256:")
        assert [a["outcome"] for a in shard["attempts"]] == ["ok"]


def test_a_killed_shard_worker_is_retried(sharded_manifest: Path, one_process_run: Path, ray_cluster: str,
                                          tmp_path: Path) -> None:
    code, output = _sharded(sharded_manifest, tmp_path / "sharded", ray_cluster, {2: 1})
    assert code == 0, output
    assert "shard 2/2 failed" in output and "retrying once" in output
    shards = read_json(tmp_path / "sharded" / "run_log.json")["shards"]
    outcomes = [a["outcome"] for a in shards[1]["attempts"]]
    assert len(outcomes) == 2 and outcomes[0].startswith("failed") and outcomes[1] == "ok", outcomes
    _check_conformant(one_process_run, tmp_path / "sharded", tmp_path / "report")


def test_a_shard_failing_twice_fails_the_run(sharded_manifest: Path, ray_cluster: str,
                                             tmp_path: Path) -> None:
    target = tmp_path / "sharded"
    code, output = _sharded(sharded_manifest, target, ray_cluster, {1: 2})
    assert code == 2, output
    assert "shard 1/2 failed 2 times" in output and "no run directory was written" in output
    assert not target.exists() and not list(tmp_path.glob(".detinf-tmp-*"))


def test_bad_ray_options_are_refused(sharded_manifest: Path, tmp_path: Path) -> None:
    result = detinf("run", "--config", sharded_manifest, "--output-dir", tmp_path / "x", "--shards", "2")
    assert result.code == 2 and "--shards: needs --ray-address" in result.err
    result = detinf("run", "--config", sharded_manifest, "--output-dir", tmp_path / "x",
                    "--ray-address", "local", "--base-url", "http://127.0.0.1:9")
    assert result.code == 2 and "--ray-address: shards run the embedded engine" in result.err
    result = detinf("run", "--config", sharded_manifest, "--output-dir", tmp_path / "x",
                    "--ray-address", "local", "--shards", "0")
    assert result.code == 2 and "--shards: 0 must be >= 1" in result.err
    assert not (tmp_path / "x").exists()
