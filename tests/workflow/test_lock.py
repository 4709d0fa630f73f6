"""Locks: deterministic, refuse unset or wrong digests, detect edits; digest-bootstrap and build."""

from __future__ import annotations

from pathlib import Path

from deterministic_inference.workflow.lock import create_lock, lock_text
from deterministic_inference.workflow.manifest import load_manifest
from tests.workflow.helpers import detinf, edit_manifest, read_json, write_json


def test_locking_twice_gives_the_same_bytes(tiny_manifest: Path) -> None:
    lock_path = tiny_manifest.with_name("tiny.lock.json")
    first = lock_path.read_bytes()
    assert detinf("lock", "--config", tiny_manifest).code == 0
    assert lock_path.read_bytes() == first
    lock = read_json(lock_path)
    assert lock["manifest_id"] == load_manifest(tiny_manifest).manifest_id
    roles = {entry["path"]: entry["role"] for entry in lock["model"]["files"]}
    assert roles["model.safetensors"] == "weights" and roles["tokenizer.json"] == "tokenizer"
    assert lock["dataset"]["records"] == 100
    assert lock["runtime_closure"]["software"]["torch"]["version"].startswith("2.")


def test_unset_digest_needs_bootstrap(tiny_manifest: Path) -> None:
    document = read_json(tiny_manifest)
    document["model"]["files"][0]["digest"] = "sha256:unset"
    write_json(tiny_manifest, document)
    refused = detinf("lock", "--config", tiny_manifest)
    assert refused.code == 2
    assert "$.model.files[0].digest" in refused.err and "digest-bootstrap" in refused.err
    filled = detinf("digest-bootstrap", "--config", tiny_manifest)
    assert filled.code == 0 and "1 digest(s) filled" in filled.out
    assert read_json(tiny_manifest)["model"]["files"][0]["digest"].startswith("sha256:")
    assert detinf("lock", "--config", tiny_manifest).code == 0


def test_bootstrap_writes_overrides_into_the_child(tiny_manifest: Path) -> None:
    base = read_json(tiny_manifest)
    base["inference"]["dataset"] = {"source": "prompts.jsonl", "digest": "sha256:unset"}
    (tiny_manifest.parent / "prompts.jsonl").write_text('{"id": "a", "prompt": "Hi"}\n')
    base["inference"]["n_prompts"] = 1
    write_json(tiny_manifest.with_name("base.json"), base)
    child = write_json(tiny_manifest.with_name("child.json"), {"x_base_manifest": "base.json"})
    assert detinf("digest-bootstrap", "--config", child).code == 0
    assert read_json(tiny_manifest.with_name("base.json"))["inference"]["dataset"]["digest"] == "sha256:unset"
    assert read_json(child)["inference"]["dataset"]["digest"].startswith("sha256:")
    assert detinf("lock", "--config", child).code == 0


def test_manifest_digest_that_differs_from_the_file_is_refused(tiny_manifest: Path) -> None:
    document = read_json(tiny_manifest)
    wrong = "sha256:" + "0" * 64
    document["model"]["files"][0]["digest"] = wrong
    write_json(tiny_manifest, document)
    refused = detinf("lock", "--config", tiny_manifest)
    assert refused.code == 2 and wrong in refused.err and "has digest sha256:" in refused.err


def test_lock_edit_is_detected(tiny_manifest: Path) -> None:
    lock_path = tiny_manifest.with_name("tiny.lock.json")
    lock = read_json(lock_path)
    lock["model"]["files"][0]["digest"] = "sha256:" + "f" * 64
    write_json(lock_path, lock)
    refused = detinf("run", "--config", tiny_manifest, "--output-dir", tiny_manifest.parent / "run")
    assert refused.code == 2
    assert str(lock_path) in refused.err and "lock_id" in refused.err and refused.err.count("sha256:") == 2
    assert not (tiny_manifest.parent / "run").exists()


def test_lock_of_another_manifest_is_refused(tiny_manifest: Path) -> None:
    edit_manifest(tiny_manifest, {"inference": {"n_prompts": 2}})
    refused = detinf("run", "--config", tiny_manifest)
    assert refused.code == 2 and "made for manifest" in refused.err and "detinf lock" in refused.err


def test_build_reports_and_updates_the_closure(tiny_manifest: Path) -> None:
    lock_path = tiny_manifest.with_name("tiny.lock.json")
    same = detinf("build", "--config", tiny_manifest)
    assert same.code == 0 and "matches the lock" in same.err
    assert read_json(lock_path)["runtime_closure_digest"] in same.out
    lock = read_json(lock_path)
    lock["runtime_closure"]["env"]["TZ"] = "Mars/Olympus"  # pretend it was locked elsewhere
    from deterministic_inference.workflow.canonical import lock_id

    lock["runtime_closure_digest"] = "sha256:" + "0" * 64
    lock["lock_id"] = lock_id(lock)
    lock_path.write_text(lock_text(lock))
    closure_file = tiny_manifest.parent / "c.json"
    updated = detinf("build", "--config", tiny_manifest, "--update-lock", "--output", closure_file)
    assert updated.code == 0 and "updated the lock" in updated.err
    fresh = read_json(lock_path)
    assert fresh["runtime_closure"] == create_lock(load_manifest(tiny_manifest))["runtime_closure"]
    assert read_json(tiny_manifest.parent / "c.json")["kind"] == "detinf.closure"
