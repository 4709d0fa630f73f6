"""Seed-tool manifests (`kind: vllm.deterministic_inference_manifest`): read with inheritance, mapped with
one warning line per unmapped field, and run against a real OpenAI-compatible server (`detinf serve`'s
app on the tiny model)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from deterministic_inference.server.app import ServerSettings
from deterministic_inference.workflow.manifest import load_manifest
from tests.server.harness import RunningServer, thread_server, tiny_config
from tests.tiny_models import TinyModel
from tests.workflow.helpers import SHARED_SEED_DIR, detinf, read_json, write_json

SEED_CHILD = "qwen3-235b-a22b-instruct-2507.json"
pytestmark = pytest.mark.skipif(
    not (SHARED_SEED_DIR / SEED_CHILD).is_file(),
    reason="the seed-tool reference manifests (../shared) are not beside the repo",
)


@pytest.fixture()
def seed_dir(tmp_path: Path) -> Path:
    """Writable copies of the seed manifests (a lock is written next to the manifest)."""
    for name in ("standard-base.json", SEED_CHILD, "standard-base.manifest.lock.json"):
        shutil.copy(SHARED_SEED_DIR / name, tmp_path / name)
    return tmp_path


@pytest.fixture(scope="module")
def server(tiny_llama_dir: TinyModel) -> Iterator[RunningServer]:
    """A real server on the tiny model (served as 'tiny')."""
    with thread_server(tiny_config(tiny_llama_dir), ServerSettings(served_model_name="tiny")) as running:
        yield running


def test_seed_manifest_is_mapped_with_warnings(seed_dir: Path) -> None:
    manifest = load_manifest(seed_dir / SEED_CHILD)
    data = manifest.data
    assert manifest.origin_kind == "vllm.deterministic_inference_manifest"
    assert [path.name for path in manifest.chain] == [SEED_CHILD, "standard-base.json"]
    assert data["metadata"]["name"] == "qwen3-235b-a22b-instruct-2507"
    assert data["model"]["source"] == {"type": "remote", "name": "Qwen/Qwen3-235B-A22B-Instruct-2507"}
    execution = data["runtime"]["execution"]
    assert (execution["backend"], execution["base_url"], execution["timeout_seconds"]) == (
        "openai_compatible", "http://127.0.0.1:8000", 1200)
    sampling = data["inference"]["request_template"]["sampling"]
    picked = (sampling["temperature"], sampling["top_p"], sampling["top_k"], sampling["seed"])
    assert picked == (0.0, 0.95, 50, 424242)
    assert data["inference"]["n_prompts"] == 100 and data["runtime"]["network_policy"] == "online_allowed"
    assert data["runtime"]["env"]["PYTHONHASHSEED"] == "0"
    assert data["outputs"]["directory"] == "runs/qwen3-235b-a22b-instruct-2507/${run_id}"
    warned = {line.split(": ")[1] for line in manifest.warnings}
    for field in ("cuda_stack", "software_stack", "vllm.env", "vllm.engine_args.tensor_parallel_size",
                  "hardware", "artifacts", "runtime.execution.vllm_image", "model.weights.files"):
        assert field in warned, field
    assert all("\n" not in line for line in manifest.warnings)


def test_seed_lock_is_recognised_not_used(seed_dir: Path) -> None:
    summary = detinf("inspect", "--input", seed_dir / "standard-base.manifest.lock.json")
    assert summary.code == 0 and "type: seed-tool lock" in summary.out
    seed_lock = seed_dir / "standard-base.manifest.lock.json"
    refused = detinf("run", "--config", seed_dir / SEED_CHILD, "--lock", seed_lock)
    assert refused.code == 2 and "seed's vLLM tool" in refused.err


def test_seed_manifest_runs_against_an_openai_endpoint(seed_dir: Path, server: RunningServer) -> None:
    child = write_json(seed_dir / "small.json", {
        "x_base_manifest": SEED_CHILD,
        "inference": {"n_prompts": 4, "request_template": {"sampling": {"max_tokens": 8}}},
        "capture": {"logits": {"enabled": True}},
    })
    locked = detinf("lock", "--config", child)
    assert locked.code == 0, locked.err
    assert locked.err.count("warning: seed manifest:") >= 10
    runs = []
    for name in ("a", "b"):
        result = detinf("run", "--config", child, "--base-url", server.base_url,
                        "--output-dir", seed_dir / name)
        assert result.code == 0, result.err
        assert "endpoint does not serve 'Qwen/Qwen3-235B-A22B-Instruct-2507'; using its model 'tiny'" \
            in result.err
        runs.append(seed_dir / name)
    tokens = read_json(runs[0] / "tokens.json")["sequences"]
    assert len(tokens) == 4 and all(item["text"] or item["output_tokens"] for item in tokens)
    logits = read_json(runs[0] / "captures" / "logits.json")["sequences"]
    assert all(len(item["token_logprobs"]) >= 1 for item in logits)
    bundle = read_json(runs[0] / "bundle.json")
    assert bundle["backend"] == "openai_compatible" and bundle["system_fingerprint"].startswith("detinf-")
    verified = detinf("verify", "--bundle-a", runs[0], "--bundle-b", runs[1], "--output-dir", seed_dir / "v")
    assert verified.code == 0 and verified.out.startswith("grade: conformant")
    report = read_json(seed_dir / "v" / "verify_report.json")
    assert report["outputs"]["logits"]["compared"] == sum(len(item["token_logprobs"]) for item in logits)
