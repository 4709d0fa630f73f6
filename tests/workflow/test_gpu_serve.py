"""GPU fleets through the workflow (untested on GPU): `detinf serve --config` on a manifest with
`runtime.execution.backend: vllm | sglang` generates a docker compose file with the determinism settings
pinned; the image is resolved in the seed tool's order and must be digest-pinned and present locally;
every refusal is one line naming the field; `detinf run --config` drives the endpoint over HTTP."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from deterministic_inference.errors import WorkflowError
from deterministic_inference.server.app import ServerSettings
from deterministic_inference.workflow.gpu_engines import VLLM
from deterministic_inference.workflow.gpu_serve import repo_digests, resolve_image, verify_local_image
from tests.server.harness import TINY_NAME, thread_server, tiny_config
from tests.tiny_models import TinyModel
from tests.workflow.helpers import detinf, edit_manifest, read_json
from tests.workflow.hf_cache_builder import REPO

PIN_A = "docker.io/vllm/vllm-openai@sha256:" + "a" * 64
PIN_B = "docker.io/vllm/vllm-openai@sha256:" + "b" * 64
PIN_C = "lmsysorg/sglang@sha256:" + "c" * 64
BASE_URL = "http://127.0.0.1:8123"


def gpu_manifest(tmp_path: Path, backend: str, **execution: Any) -> Path:
    """An HF-cache manifest for `backend`, locked."""
    path = tmp_path / f"{backend}.json"
    result = detinf("init", "--output", path, "--model-id", REPO, "--n-prompts", "2", "--max-tokens", "4")
    assert result.code == 0, result.err
    edit_manifest(path, {"runtime": {"execution": {"backend": backend, "base_url": BASE_URL, **execution}}})
    locked = detinf("lock", "--config", path)
    assert locked.code == 0, locked.err
    return path


def dry_run(path: Path, *extra: str) -> tuple[dict[str, Any], str]:
    result = detinf("serve", "--config", path, "--dry-run", *extra)
    assert result.code == 0, result.err
    compose = path.with_name(path.name.removesuffix(".json") + ".compose.yaml")
    return yaml.safe_load(compose.read_text()), result.err


def refused(path: Path, *extra: str) -> str:
    result = detinf("serve", "--config", path, "--dry-run", *extra)
    assert result.code == 2, result.out
    assert result.err.count("\n") == 1, result.err
    return result.err


def test_vllm_compose_pins_determinism(hf_env: tuple[str, dict[str, str]], tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    commit, _ = hf_env
    monkeypatch.delenv("VLLM_IMAGE", raising=False)
    path = gpu_manifest(tmp_path, "vllm", vllm_image=PIN_A, engine_args={"gpu_memory_utilization": 0.85})
    compose, err = dry_run(path)
    service = compose["services"]["vllm"]
    assert service["image"] == PIN_A and "$.runtime.execution.vllm_image" in err
    env, command = service["environment"], service["command"]
    assert env["VLLM_BATCH_INVARIANT"] == "1" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and env["HF_HUB_OFFLINE"] == "1"
    pairs = dict(zip(command[::2], command[1::2], strict=False))
    assert pairs["--model"] == REPO and pairs["--revision"] == "main"
    assert command[command.index("--attention-backend") + 1] == "FLASH_ATTN"
    assert command[command.index("--seed") + 1] == "0"
    assert command[-2:] == ["--gpu-memory-utilization", "0.85"]
    assert service["ports"] == ["127.0.0.1:8123:8000"]
    assert service["volumes"][0].endswith(":/root/.cache/huggingface/hub:ro")
    lock = read_json(path.with_name("vllm.lock.json"))
    assert service["labels"]["org.detinf.manifest_id"] == lock["manifest_id"]
    assert commit  # the cache's main: the lock records the commit (checked as for `detinf run`)
    again = path.with_name("vllm.compose.yaml").read_bytes()
    dry_run(path)
    assert path.with_name("vllm.compose.yaml").read_bytes() == again  # deterministic file


def test_sglang_compose_pins_determinism(hf_env: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    path = gpu_manifest(tmp_path, "sglang", sglang_image=PIN_C, enforce_eager=True)
    compose, _ = dry_run(path)
    command = compose["services"]["sglang"]["command"]
    assert command[:4] == ["python3", "-m", "sglang.launch_server", "--enable-deterministic-inference"]
    assert command[command.index("--attention-backend") + 1] == "fa3"
    assert command[command.index("--model-path") + 1] == REPO and "--random-seed" in command
    assert "--disable-cuda-graph" in command
    assert compose["services"]["sglang"]["ports"] == ["127.0.0.1:8123:30000"]


def test_image_resolution_order_and_pinning() -> None:
    execution = {"vllm_image": PIN_B}
    assert resolve_image(VLLM, PIN_A, execution, {"VLLM_IMAGE": PIN_C}) == (PIN_A, "--image")
    assert resolve_image(VLLM, None, execution, {"VLLM_IMAGE": PIN_C})[0] == PIN_B
    assert resolve_image(VLLM, None, {}, {"VLLM_IMAGE": PIN_C}) == (PIN_C, "$VLLM_IMAGE")
    for cli, manifest, env, where in (
        ("vllm/vllm-openai:latest", None, None, "--image"),
        (None, "vllm/vllm-openai:v0.9.0", None, "$.runtime.execution.vllm_image"),
        (None, None, "vllm/vllm-openai@sha256:abc", "$VLLM_IMAGE"),
    ):
        with pytest.raises(WorkflowError, match="not pinned by digest") as error:
            resolve_image(VLLM, cli, {"vllm_image": manifest}, {"VLLM_IMAGE": env} if env else {})
        assert str(error.value).startswith(where)
    with pytest.raises(WorkflowError, match="no vllm image"):
        resolve_image(VLLM, None, {}, {})


def test_cli_image_and_env_order(hf_env: tuple[str, dict[str, str]], tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = gpu_manifest(tmp_path, "vllm")
    monkeypatch.setenv("VLLM_IMAGE", PIN_B)
    assert dry_run(path)[0]["services"]["vllm"]["image"] == PIN_B
    assert dry_run(path, "--image", PIN_A)[0]["services"]["vllm"]["image"] == PIN_A
    monkeypatch.delenv("VLLM_IMAGE")
    assert "no vllm image" in refused(path)


@pytest.mark.parametrize(
    ("execution", "env", "field"),
    [
        ({"attention_backend": "XFORMERS"}, {}, "$.runtime.execution.attention_backend"),
        ({"engine_args": {"seed": 3}}, {}, "$.runtime.execution.engine_args.seed"),
        ({}, {"VLLM_BATCH_INVARIANT": "0"}, "$.runtime.env.VLLM_BATCH_INVARIANT"),
        ({"base_url": None}, {}, "$.runtime.execution.base_url"),
    ],
)
def test_settings_that_would_undo_determinism_are_refused(
    hf_env: tuple[str, dict[str, str]], tmp_path: Path, execution: dict[str, Any], env: dict[str, str],
    field: str,
) -> None:
    path = gpu_manifest(tmp_path, "vllm", vllm_image=PIN_A)
    edit_manifest(path, {"runtime": {"execution": execution, "env": env}})
    assert detinf("lock", "--config", path).code == 0
    assert field in refused(path)


def test_other_refusals(hf_env: tuple[str, dict[str, str]], tmp_path: Path, tiny_model_copy: Path) -> None:
    path = gpu_manifest(tmp_path, "vllm", vllm_image=PIN_A)
    edit_manifest(path, {"engine": {"batch_invariant": False}})
    assert detinf("lock", "--config", path).code == 0
    assert "$.engine.batch_invariant" in refused(path)
    assert "--model" in refused(path, "--model", str(tiny_model_copy))
    local = tmp_path / "local.json"
    assert detinf("init", "--output", local, "--model", tiny_model_copy).code == 0
    edit_manifest(local, {"runtime": {"execution": {"backend": "sglang", "base_url": BASE_URL}}})
    assert "$.model.source" in refused(local)


@pytest.mark.skipif(shutil.which("docker") is None, reason="the docker CLI is not installed")
def test_local_image_is_verified_with_docker() -> None:
    """Whatever the daemon's state here, an image that is not present locally is refused before start."""
    with pytest.raises(WorkflowError, match="cannot inspect the local image|not the pinned"):
        verify_local_image("docker.io/library/detinf-absent@sha256:" + "d" * 64)


def test_docker_missing_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(WorkflowError, match="docker: not found on PATH"):
        verify_local_image(PIN_A)


def test_repo_digests_parse_docker_inspect_output() -> None:
    output = '["docker.io/vllm/vllm-openai@sha256:' + "a" * 64 + '","mirror/vllm@sha256:' + "e" * 64 + '"]\n'
    assert repo_digests(output) == {"sha256:" + "a" * 64, "sha256:" + "e" * 64}
    assert repo_digests("[]") == set() and repo_digests("null") == set() and repo_digests("garbage") == set()


def test_run_drives_the_engine_endpoint(hf_env: tuple[str, dict[str, str]], tmp_path: Path,
                                        tiny_llama_dir: TinyModel) -> None:
    """`detinf run --config` on a vllm-backend manifest sends its requests to runtime.execution.base_url
    (here our own server stands in for the GPU engine: both speak the OpenAI API)."""
    with thread_server(tiny_config(tiny_llama_dir), ServerSettings(served_model_name=TINY_NAME)) as server:
        path = gpu_manifest(tmp_path, "vllm", vllm_image=PIN_A)
        edit_manifest(path, {"runtime": {"execution": {"base_url": server.base_url}}})
        assert detinf("lock", "--config", path).code == 0
        result = detinf("run", "--config", path, "--output-dir", tmp_path / "run")
    assert result.code == 0, result.err
    log = read_json(tmp_path / "run" / "run_log.json")
    assert read_json(tmp_path / "run" / "bundle.json")["backend"] == "openai_compatible"
    assert len(read_json(tmp_path / "run" / "tokens.json")["sequences"]) == 2 and log


def test_gpu_options_without_a_gpu_backend_are_refused(tiny_manifest: Path) -> None:
    result = detinf("serve", "--config", tiny_manifest, "--dry-run")
    assert result.code == 2 and "--dry-run" in result.err and "'embedded'" in result.err
