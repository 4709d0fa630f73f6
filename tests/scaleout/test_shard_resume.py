"""Sharded runs keep a checkpoint per shard: a shard worker SIGKILLed inside a checkpoint write is run
again from its checkpoint, and a whole sharded run killed (driver and workers) continues with --resume;
both publish the one-process run's bytes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from deterministic_inference.workflow import checkpoint
from tests.server.harness import detinf_command
from tests.tiny_models import TinyModel
from tests.workflow.helpers import detinf, edit_manifest, read_json

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
WORKER_PID = re.compile(r"shard \d+/\d+: \d+ request\(s\) on worker pid (\d+)")
SAME_BYTES = ("tokens.json", "requests.json", "captures/logits.json", "captures/activations.json")


@pytest.fixture(scope="module")
def hooked_manifest(tiny_llama_dir: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 prompts run one at a time (3 groups per shard); the kill hook armed through runtime.env, firing
    once in all processes: only where its marker file does not exist yet."""
    root = tmp_path_factory.mktemp("shard-resume")
    path = root / "m.json"
    created = detinf("init", "--output", path, "--model", tiny_llama_dir.path, "--n-prompts", "6",
                     "--max-tokens", "16")
    assert created.code == 0, created.err
    hook = f"2:mid_record:{root / 'fired'}"
    edit_manifest(path, {"engine": {"num_kv_blocks": 256},
                         "inference": {"batching": {"policy": "sequential"}},
                         "runtime": {"env": {checkpoint.TEST_KILL_HOOK: hook}},
                         "capture": {"activations": {"enabled": True}, "logits": {"enabled": True}}})
    assert detinf("lock", "--config", path).code == 0
    return path


@pytest.fixture(scope="module")
def one_process(hooked_manifest: Path) -> Path:
    """The reference: one process, uninterrupted (the hook disarmed by its marker)."""
    marker = hooked_manifest.parent / "fired"
    marker.touch()
    target = hooked_manifest.parent / "one-process"
    result = detinf("run", "--config", hooked_manifest, "--output-dir", target)
    marker.unlink()
    assert result.code == 0, result.err
    return target


def _command(manifest: Path, target: Path, address: str, *extra: str) -> list[str]:
    return [*detinf_command(), "run", "--config", str(manifest), "--output-dir", str(target),
            "--ray-address", address, "--shards", "2", "--quiet", *extra]


def _same_as(reference: Path, run: Path, report: Path) -> None:
    for name in SAME_BYTES:
        assert (run / name).read_bytes() == (reference / name).read_bytes(), name
    graded = detinf("verify", "--bundle-a", reference, "--bundle-b", run, "--output-dir", report)
    assert graded.code == 0 and "grade: conformant" in graded.out, graded.out
    assert not checkpoint.checkpoint_dir(run).exists()


def test_a_shard_killed_inside_a_checkpoint_write_continues_from_its_checkpoint(
    hooked_manifest: Path, one_process: Path, ray_cluster: str, tmp_path: Path
) -> None:
    target = tmp_path / "sharded"
    done = subprocess.run(_command(hooked_manifest, target, ray_cluster), capture_output=True, text=True,
                          timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (hooked_manifest.parent / "fired").exists() and "retrying once" in done.stderr
    _same_as(one_process, target, tmp_path / "report")
    shards = read_json(target / "run_log.json")["checkpoint"]["shards"]
    resumed = [shard for shard in shards if shard["resumes"]]
    assert len(resumed) == 1 and len(shards) == 2
    (event,) = resumed[0]["resumes"]
    assert event["requests_done"] == 1 and event["torn_record_dropped"] is True
    assert event["requests_total"] == 3


def test_a_killed_sharded_run_resumes(hooked_manifest: Path, one_process: Path, ray_cluster: str,
                                      tmp_path: Path) -> None:
    (hooked_manifest.parent / "fired").touch(exist_ok=True)  # no self-kill: the test kills everything
    target = tmp_path / "sharded"
    folder = checkpoint.checkpoint_dir(target)
    process = subprocess.Popen(_command(hooked_manifest, target, ray_cluster), stderr=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, text=True, cwd=ROOT)
    workers: list[int] = []
    assert process.stderr is not None
    for line in process.stderr:
        match = WORKER_PID.search(line)
        if match:
            workers.append(int(match.group(1)))
        if len(workers) == 2:
            break
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not _has_segment(folder):
        time.sleep(0.005)
    for pid in [process.pid, *workers]:  # the machine goes away: driver and workers at once
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait(timeout=60)
    assert not target.exists() and _has_segment(folder)

    refused = detinf("run", "--config", hooked_manifest, "--output-dir", target, "--ray-address",
                     ray_cluster)
    assert refused.code == 2 and "pass --resume" in refused.err
    resumed = subprocess.run(_command(hooked_manifest, target, ray_cluster, "--resume"),
                             capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming from {folder}" in resumed.stderr
    _same_as(one_process, target, tmp_path / "report")
    log = read_json(target / "run_log.json")["checkpoint"]
    assert log["interrupted"] is True
    assert sum(event["requests_done"] for shard in log["shards"] for event in shard["resumes"]) >= 1


def _has_segment(folder: Path) -> bool:
    for records in folder.glob("shard-*/" + checkpoint.RECORDS_FILE):
        try:
            if any(record.get("type") == "segment" for record in checkpoint.read_records(records).records):
                return True
        except Exception:  # noqa: BLE001 - being written right now; look again
            continue
    return False
