"""`detinf run --resume`: a run SIGKILLed at several points (inside a checkpoint write too) and resumed
publishes the uninterrupted run's bytes; changed inputs and damaged checkpoints are refused.

The kills are made deterministic by the checkpoint writer's test hook (`checkpoint.TEST_KILL_HOOK`): the
killed `detinf run` is a separate process that SIGKILLs itself while appending a given segment record.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from deterministic_inference.workflow import checkpoint
from deterministic_inference.workflow.lock import with_closure, write_lock
from tests.tiny_models import TinyModel
from tests.workflow.helpers import detinf, edit_manifest, read_json

ROOT = Path(__file__).resolve().parents[2]
DETERMINISTIC_FILES = ("manifest.used.json", "lock.used.json", "requests.json", "tokens.json",
                       "captures/logits.json", "captures/activations.json",
                       "captures/activations.safetensors", "captures/engine_trace.json")


@pytest.fixture(scope="module")
def resume_manifest(tiny_llama_dir: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """5 chat prompts, 10 tokens each, 2 requests per group (3 segments), every capture on."""
    root = tmp_path_factory.mktemp("resume")
    path = root / "m.json"
    created = detinf("init", "--output", path, "--model", tiny_llama_dir.path, "--n-prompts", "5",
                     "--max-tokens", "10")
    assert created.code == 0, created.err
    edit_manifest(path, {"engine": {"num_kv_blocks": 256},
                         "inference": {"batching": {"max_num_seqs": 2}},
                         "capture": {"logits": {"enabled": True},
                                     "activations": {"enabled": True, "full_tensors": True}}})
    assert detinf("lock", "--config", path).code == 0
    return path


@pytest.fixture(scope="module")
def reference_run(resume_manifest: Path) -> Path:
    """The uninterrupted run."""
    target = resume_manifest.parent / "uninterrupted"
    result = detinf("run", "--config", resume_manifest, "--output-dir", target)
    assert result.code == 0, result.err
    return target


def killed_run(manifest: Path, target: Path, hook: str) -> subprocess.CompletedProcess[str]:
    """`detinf run` in a subprocess that SIGKILLs itself at the hook's point."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), checkpoint.TEST_KILL_HOOK: hook}
    command = [sys.executable, "-m", "deterministic_inference", "run", "--config", str(manifest),
               "--output-dir", str(target)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)


def assert_same_bytes(reference: Path, resumed: Path) -> None:
    """Every deterministic file, and the bundle record but for run_log.json's digest, byte-equal."""
    for name in DETERMINISTIC_FILES:
        assert (resumed / name).read_bytes() == (reference / name).read_bytes(), name
    bundle_a, bundle_b = read_json(reference / "bundle.json"), read_json(resumed / "bundle.json")
    for bundle in (bundle_a, bundle_b):
        del bundle["files"]["run_log.json"], bundle["bundle_digest"]
    assert bundle_a == bundle_b


@pytest.mark.parametrize(("hook", "done", "torn"), [
    ("1:mid_record", 0, True),     # torn inside the first record: dropped, everything runs again
    ("1:after_fsync", 2, False),   # between groups, the first one durable
    ("2:before_fsync", 4, False),  # record written, not yet fsync'd (the kill keeps the page cache)
    ("3:mid_record", 4, True),     # inside the last record
])
def test_killed_run_resumes_to_the_uninterrupted_bytes(resume_manifest: Path, reference_run: Path,
                                                       hook: str, done: int, torn: bool) -> None:
    target = resume_manifest.parent / f"killed-{hook.replace(':', '-')}"
    killed = killed_run(resume_manifest, target, hook)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not target.exists()
    staging = checkpoint.checkpoint_dir(target)
    assert staging.is_dir()

    refused = detinf("run", "--config", resume_manifest, "--output-dir", target)
    assert refused.code == 2 and "pass --resume" in refused.err and str(staging) in refused.err
    assert f"{done} of 5 requests done" in refused.err and staging.is_dir()

    resumed = detinf("run", "--config", resume_manifest, "--output-dir", target, "--resume")
    assert resumed.code == 0, resumed.err
    assert f"resuming from {staging}: {done}/5 requests done" in resumed.err
    assert not staging.exists()
    assert_same_bytes(reference_run, target)
    graded = detinf("verify", "--bundle-a", reference_run, "--bundle-b", target,
                    "--output-dir", target.parent / f"report-{target.name}")
    assert graded.code == 0 and "conformant" in graded.out
    log = read_json(target / "run_log.json")["checkpoint"]
    assert log["interrupted"] is True and log["segments"] == 3
    (event,) = log["resumes"]
    assert event["requests_done"] == done and event["requests_total"] == 5
    assert event["torn_record_dropped"] is torn and event["interrupted_after"] <= event["resumed_at"]


def test_negative_control_groups_sharing_the_prefix_cache_differ(
    resume_manifest: Path, reference_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the flush between groups, a group's trace depends on the groups run before it in the same
    process: the comparison above then sees a difference (so it can fail)."""
    from deterministic_inference.engine.engine import Engine

    monkeypatch.setattr(Engine, "flush_prefix_cache", lambda self: 0)
    target = tmp_path / "unflushed"
    assert detinf("run", "--config", resume_manifest, "--output-dir", target).code == 0
    assert (target / "tokens.json").read_bytes() == (reference_run / "tokens.json").read_bytes()
    assert (target / "captures/engine_trace.json").read_bytes() != \
        (reference_run / "captures/engine_trace.json").read_bytes()
    graded = detinf("verify", "--bundle-a", reference_run, "--bundle-b", target,
                    "--output-dir", tmp_path / "r")
    assert graded.code == 1


def _leave_checkpoint(manifest: Path, target: Path) -> Path:
    killed = killed_run(manifest, target, "2:after_fsync")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    return checkpoint.checkpoint_dir(target)


def _refusal(manifest: Path, target: Path) -> str:
    result = detinf("run", "--config", manifest, "--output-dir", target, "--resume")
    assert result.code == 2 and not target.exists()
    assert checkpoint.checkpoint_dir(target).is_dir()
    (line,) = [line for line in result.err.splitlines() if "error:" in line]
    return line


def test_resume_refuses_changed_inputs_and_damaged_checkpoints(
    resume_manifest: Path, tiny_llama_dir: TinyModel, tmp_path: Path
) -> None:
    manifest = tmp_path / "m.json"
    edit_manifest(resume_manifest, {}, output=manifest)
    lock_path = manifest.with_name("m.lock.json")
    assert detinf("lock", "--config", manifest).code == 0
    target = tmp_path / "run"
    staging = _leave_checkpoint(manifest, target)

    lock = read_json(lock_path)
    write_lock(lock_path, with_closure(lock, dict(lock["runtime_closure"], python="0.0.0-other")))
    assert "was made with lock " + lock["lock_id"] in _refusal(manifest, target)
    write_lock(lock_path, lock)

    edit_manifest(manifest, {"inference": {"request_template": {"sampling": {"max_tokens": 9}}}})
    assert detinf("lock", "--config", manifest).code == 0
    assert "was made with manifest sha256:" in _refusal(manifest, target)
    edit_manifest(manifest, {"inference": {"request_template": {"sampling": {"max_tokens": 10}}}})
    assert detinf("lock", "--config", manifest).code == 0

    records = staging / checkpoint.RECORDS_FILE
    original = records.read_bytes()
    lines = original.split(b"\n")
    lines[2] = lines[2].replace(b'"index":0', b'"index":7')  # the first segment record, checksum now wrong
    records.write_bytes(b"\n".join(lines))
    assert "record 3 is corrupt" in _refusal(manifest, target)
    records.write_bytes(original)

    resumed = detinf("run", "--config", manifest, "--output-dir", target, "--resume")
    assert resumed.code == 0, resumed.err
    assert "4/5 requests done" in resumed.err


def test_resume_refuses_a_changed_model(resume_manifest: Path, tiny_llama_dir: TinyModel,
                                        tmp_path: Path) -> None:
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir.path, model)
    manifest = tmp_path / "m.json"
    assert detinf("init", "--output", manifest, "--model", model, "--n-prompts", "5",
                  "--max-tokens", "10").code == 0
    edit_manifest(manifest, read_json(resume_manifest) | {"model": read_json(manifest)["model"]})
    assert detinf("lock", "--config", manifest).code == 0
    target = tmp_path / "run"
    _leave_checkpoint(manifest, target)
    tokenizer = model / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text() + " ")
    assert detinf("digest-bootstrap", "--config", manifest, "--replace-existing", "--write-lock").code == 0
    assert "was made with model files sha256:" in _refusal(manifest, target)
