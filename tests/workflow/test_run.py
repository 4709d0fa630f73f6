"""`detinf run` on the tiny random model: refusals before loading, run directory contents, verify, bundle."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deterministic_inference.workflow.dataset import dataset_path
from deterministic_inference.workflow.rundir import load_run_dir
from tests.workflow.helpers import detinf, edit_manifest, read_json


def _tamper(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # last byte of the last tensor / of the JSON's trailing whitespace
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json"])
def test_tampered_model_file_is_refused(tiny_manifest: Path, tiny_model_copy: Path, name: str) -> None:
    lock = read_json(tiny_manifest.with_name("tiny.lock.json"))
    locked = next(entry["digest"] for entry in lock["model"]["files"] if entry["path"] == name)
    _tamper(tiny_model_copy / name)
    result = detinf("run", "--config", tiny_manifest, "--output-dir", tiny_manifest.parent / "run")
    assert result.code == 2
    assert str(tiny_model_copy / name) in result.err and locked in result.err
    assert result.err.count("sha256:") == 2 and "\n" not in result.err.strip()
    assert not (tiny_manifest.parent / "run").exists()


def test_tampered_prompt_file_is_refused(tiny_manifest: Path) -> None:
    prompts = tiny_manifest.with_name("prompts.jsonl")
    shutil.copy(dataset_path("builtin:reference_prompts", Path(".")), prompts)
    dataset = {"source": "prompts.jsonl", "digest": "sha256:unset"}
    edit_manifest(tiny_manifest, {"inference": {"dataset": dataset}})
    assert detinf("digest-bootstrap", "--config", tiny_manifest).code == 0
    assert detinf("lock", "--config", tiny_manifest).code == 0
    prompts.write_text(prompts.read_text().replace("grey kitten", "grey puppy"))
    result = detinf("run", "--config", tiny_manifest)
    assert result.code == 2 and str(prompts) in result.err and result.err.count("sha256:") == 2


def test_skipping_digest_checks_runs_and_says_so(tiny_manifest: Path, tiny_model_copy: Path) -> None:
    _tamper(tiny_model_copy / "model.safetensors")
    out = tiny_manifest.parent / "run"
    result = detinf("run", "--config", tiny_manifest, "--output-dir", out, "--no-verify-artifact-digests")
    assert result.code == 0, result.err
    assert "artifact digests not verified" in result.err
    log = read_json(out / "run_log.json")
    assert log["determinism_controls"]["artifact_digests_verified"] is False


def test_run_dir_contents_and_two_runs_conformant(tiny_manifest: Path, tmp_path: Path) -> None:
    assert detinf("run", "--config", tiny_manifest, "--output-dir", tmp_path / "a").code == 0
    assert detinf("run", "--config", tiny_manifest, "--output-dir", tmp_path / "b").code == 0
    run = load_run_dir(tmp_path / "a")
    assert sorted(run.bundle["files"]) == [
        "captures/activations.json", "captures/engine_trace.json", "captures/logits.json", "lock.used.json",
        "manifest.used.json", "requests.json", "run_log.json", "tokens.json",
    ]
    sequences = run.tokens["sequences"]
    assert [s["request_id"] for s in sequences] == ["req-0000", "req-0001", "req-0002"]
    assert all(s["prompt_token_ids"] and s["output_token_ids"] for s in sequences)
    logits = run.read_json("captures/logits.json")
    assert len(logits["sequences"][0]["top_logprobs"][0]) == 5
    assert len(logits["sequences"][0]["token_logprobs"]) == len(sequences[0]["output_token_ids"])
    activations = run.read_json("captures/activations.json")
    assert activations["layers"] == 3  # 2 decoder layers + final norm
    first = activations["sequences"][0]
    total = len(sequences[0]["prompt_token_ids"]) + len(sequences[0]["output_token_ids"]) - 1
    assert first["positions"] == list(range(total))
    trace = run.read_json("captures/engine_trace.json")
    assert trace["steps"][0]["chunks"][0]["request_id"] == "req-0000-0"
    log = read_json(tmp_path / "a" / "run_log.json")
    assert log["determinism_controls"]["offline_guard"] is True and log["timings"]["generate_seconds"] > 0
    verified = detinf("verify", "--bundle-a", tmp_path / "a", "--bundle-b", tmp_path / "b",
                      "--output-dir", tmp_path / "v")
    assert verified.code == 0 and verified.out.startswith("grade: conformant")
    report = read_json(tmp_path / "v" / "verify_report.json")
    assert report["grade"] == "conformant" and report["outputs"]["logits"]["bit_equal"] > 0
    assert report["outputs"]["activations"]["compared_rows"] > 0
    assert (tmp_path / "v" / "verify_summary.txt").read_text().startswith("grade: conformant")


def test_changed_seed_is_mismatch_at_the_first_divergence(tiny_manifest: Path, tmp_path: Path) -> None:
    sampling = {"temperature": 1.0, "max_tokens": 6}
    for name, seed in (("s1", 1), ("s2", 2)):
        change = {"inference": {"request_template": {"sampling": dict(sampling, seed=seed)}}}
        path = edit_manifest(tiny_manifest, change, tmp_path / f"{name}.json")
        assert detinf("lock", "--config", path).code == 0
        assert detinf("run", "--config", path, "--output-dir", tmp_path / name).code == 0
    result = detinf("verify", "--bundle-a", tmp_path / "s1", "--bundle-b", tmp_path / "s2",
                    "--output-dir", tmp_path / "v")
    assert result.code == 1
    report = read_json(tmp_path / "v" / "verify_report.json")
    assert report["grade"] == "mismatch_outputs" and not report["requests_equal"]
    expected = _first_divergence(tmp_path / "s1", tmp_path / "s2")
    found = report["outputs"]["tokens"]["first_divergence"]
    assert (found["request_id"], found["step"], found["token_a"], found["token_b"]) == expected
    trace = read_json(tmp_path / "s1" / "captures" / "engine_trace.json")
    sampled = [s["step_id"] for s in trace["steps"] for c in s["chunks"]
               if c["request_id"] == f"{expected[0]}-0" and c["sample"]]
    assert found["engine_step_a"] == sampled[expected[1]]
    assert "first divergence: request" in result.out


def _first_divergence(a: Path, b: Path) -> tuple[str, int, int, int]:
    left = read_json(a / "tokens.json")["sequences"]
    right = read_json(b / "tokens.json")["sequences"]
    for x, y in zip(left, right, strict=True):
        for step, (tx, ty) in enumerate(zip(x["output_token_ids"], y["output_token_ids"], strict=False)):
            if tx != ty:
                return x["request_id"], step, tx, ty
    raise AssertionError("the two seeds produced identical tokens")


def test_bundle_is_byte_identical_and_verifiable(tiny_manifest: Path, tmp_path: Path) -> None:
    assert detinf("run", "--config", tiny_manifest, "--output-dir", tmp_path / "run").code == 0
    assert detinf("bundle", "--run-dir", tmp_path / "run", "--output", tmp_path / "one.tar.gz").code == 0
    copy = tmp_path / "elsewhere" / "renamed"
    shutil.copytree(tmp_path / "run", copy)  # new mtimes, new path, same content
    assert detinf("bundle", "--run-dir", copy, "--output", tmp_path / "two.tar.gz").code == 0
    assert (tmp_path / "one.tar.gz").read_bytes() == (tmp_path / "two.tar.gz").read_bytes()
    result = detinf("verify", "--bundle-a", tmp_path / "one.tar.gz", "--bundle-b", tmp_path / "run",
                    "--output-dir", tmp_path / "v")
    assert result.code == 0 and "conformant" in result.out
    summary = detinf("inspect", "--input", tmp_path / "one.tar.gz")
    assert summary.code == 0 and "type: run" in summary.out and "sequences: 3" in summary.out



def test_full_activation_tensors_on_request(tiny_manifest: Path, tmp_path: Path) -> None:
    edit_manifest(tiny_manifest, {"capture": {"activations": {"enabled": True, "full_tensors": True}}})
    assert detinf("lock", "--config", tiny_manifest).code == 0
    assert detinf("run", "--config", tiny_manifest, "--output-dir", tmp_path / "run").code == 0
    run = load_run_dir(tmp_path / "run")
    tensors = load_file(str(tmp_path / "run" / "captures" / "activations.safetensors"))
    first = run.read_json("captures/activations.json")["sequences"][0]
    rows = tensors["req-0000-0/layer02"]  # final norm output of the first sequence
    assert rows.shape == (len(first["positions"]), 64)  # every position, hidden size 64
    row_bytes = rows[3].contiguous().view(torch.uint8).numpy().tobytes()
    assert hashlib.sha256(row_bytes).hexdigest() == first["digests"][3][2]
