"""Golden checks through the manifest (outputs.golden), the reference dataset, inspect on every kind."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from deterministic_inference.workflow.canonical import digest_bytes
from deterministic_inference.workflow.dataset import (
    REFERENCE_DATASET,
    REFERENCE_DATASET_DIGEST,
    dataset_path,
    load_dataset,
)
from tests.workflow.helpers import detinf, edit_manifest


def test_reference_dataset_is_pinned_and_varied() -> None:
    path = dataset_path(REFERENCE_DATASET, Path("."))
    assert digest_bytes(path.read_bytes()) == REFERENCE_DATASET_DIGEST
    dataset = load_dataset(REFERENCE_DATASET, Path("."))
    assert len(dataset.records) == 100 and len({r["id"] for r in dataset.records}) == 100
    categories = Counter(record["category"] for record in dataset.records)
    assert set(categories) == {"chat", "code", "long", "multilingual", "reasoning"}
    assert min(categories.values()) >= 10
    first_five = {record["category"] for record in dataset.records[:5]}
    assert len(first_five) == 5  # interleaved: any prefix is varied
    assert any(ord(ch) > 0x3000 for record in dataset.records for ch in record["prompt"])  # CJK present


def test_golden_bundle_check_in_the_manifest(tiny_manifest: Path, tmp_path: Path) -> None:
    assert detinf("run", "--config", tiny_manifest, "--output-dir", tmp_path / "ref").code == 0
    assert detinf("bundle", "--run-dir", tmp_path / "ref", "--output", tmp_path / "golden.tar.gz").code == 0
    golden = {"outputs": {"golden": {"enabled": True, "bundle": "golden.tar.gz"}}}
    checked = edit_manifest(tiny_manifest, golden, tmp_path / "checked.json")
    (tmp_path / "golden.tar.gz").rename(checked.parent / "golden.tar.gz")
    assert detinf("lock", "--config", checked).code == 0
    result = detinf("run", "--config", checked, "--output-dir", tmp_path / "new")
    assert result.code == 0, result.err
    assert "golden check against" in result.out and ": conformant" in result.out
    report = json.loads((tmp_path / "new.golden" / "verify_report.json").read_text())
    assert report["grade"] == "conformant"


def test_inspect_every_kind(tiny_manifest: Path, tmp_path: Path) -> None:
    assert detinf("run", "--config", tiny_manifest, "--output-dir", tmp_path / "run").code == 0
    detinf("verify", "--bundle-a", tmp_path / "run", "--bundle-b", tmp_path / "run", "--output-dir", tmp_path)
    expectations = {
        tiny_manifest: "type: manifest",
        tiny_manifest.with_name("tiny.lock.json"): "lock_id_valid: true",
        tmp_path / "run": "type: run",
        tmp_path / "run" / "bundle.json": "type: run",
        tmp_path / "verify_report.json": "grade: conformant",
    }
    for path, expected in expectations.items():
        result = detinf("inspect", "--input", path)
        assert result.code == 0 and expected in result.out, (path, result.out, result.err)
    as_json = detinf("inspect", "--input", tiny_manifest, "--json")
    assert json.loads(as_json.out)["n_prompts"] == 3
    missing = detinf("inspect", "--input", tmp_path / "nothing.json")
    assert missing.code == 2
