"""``detinf serve --config`` for a manifest whose ``runtime.execution.backend`` is ``vllm`` or ``sglang``:
start that GPU engine in a container through ``docker compose``, with its determinism settings pinned
(`gpu_engines`). Untested on GPU: the tests check the generated compose file, the image resolution
order and every refusal.

The image is resolved in the seed tool's order: ``--image``, then ``runtime.execution.vllm_image`` (or
``sglang_image``), then ``$VLLM_IMAGE`` (or ``$SGLANG_IMAGE``). It must be pinned by digest
(``name@sha256:<64 hex>``), and before anything starts the local image's repo digests must contain that
digest (``--pull`` fetches it first). The model comes from the manifest's ``huggingface`` source; the host's
Hugging Face cache is mounted read-only, and with ``network_policy: offline_required`` the engine runs
with the hub offline (the snapshot must be in the cache, and its files match the lock: the same checks as
``detinf run``). The engine listens on the host at the port of ``runtime.execution.base_url``, where
``detinf run --config`` and ``detinf audit --base-url`` then reach it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from deterministic_inference.errors import WorkflowError
from deterministic_inference.workflow.gpu_engines import ENGINES, GpuEngine, engine_command, engine_env
from deterministic_inference.workflow.hf_cache import hub_cache_dir
from deterministic_inference.workflow.manifest import Manifest

_PINNED_IMAGE = re.compile(r"^[a-z0-9][a-z0-9._:/-]*@sha256:[0-9a-f]{64}$")
CONTAINER_HF_CACHE = "/root/.cache/huggingface/hub"
DOCKER_TIMEOUT = 3600  # seconds for a pull; inspect and compose up are quick


@dataclass(frozen=True)
class ServePlan:
    """Everything `start` needs; `compose` is the compose file's content."""

    engine: str  # "vllm" or "sglang"
    image: str  # digest-pinned reference
    image_source: str  # which setting named it
    project: str  # compose project and container name
    base_url: str  # where clients reach the engine
    compose: dict[str, Any]

    def compose_text(self, command_line: str) -> str:
        """The compose file: a header naming the command that wrote it, then deterministic YAML."""
        header = f"# written by `{command_line}`; regenerate rather than edit (untested on GPU)\n"
        return header + yaml.safe_dump(self.compose, sort_keys=False, allow_unicode=True)


def resolve_image(engine: GpuEngine, cli_image: str | None, execution: Mapping[str, Any],
                  environ: Mapping[str, str]) -> tuple[str, str]:
    """(image, where it came from), in the order --image, runtime.execution.<engine>_image, $<ENGINE>_IMAGE;
    refused unless pinned by digest."""
    for value, source in ((cli_image, "--image"),
                          (execution.get(engine.image_field), f"$.runtime.execution.{engine.image_field}"),
                          (environ.get(engine.image_env), f"${engine.image_env}")):
        if value:
            image = value.strip()
            if not _PINNED_IMAGE.match(image):
                raise WorkflowError(f"{source}: {image!r} is not pinned by digest; write it as "
                                    "NAME@sha256:<64 lower-case hex> (`docker image inspect --format "
                                    "'{{index .RepoDigests 0}}' NAME:TAG` shows it)")
            return image, source
    raise WorkflowError(f"no {engine.name} image: pass --image NAME@sha256:..., set "
                        f"runtime.execution.{engine.image_field} in the manifest, or set ${engine.image_env}")


def build_plan(manifest: Manifest, cli_image: str | None, served_name: str | None,
               environ: Mapping[str, str] | None = None) -> ServePlan:
    """The serve plan of a GPU-backend manifest (refusals name the field and the fix)."""
    env = os.environ if environ is None else environ
    data = manifest.data
    execution = data["runtime"]["execution"]
    engine = ENGINES[execution["backend"]]
    image, source = resolve_image(engine, cli_image, execution, env)
    if not data["engine"]["batch_invariant"]:
        raise WorkflowError(f"{manifest.path}: $.engine.batch_invariant: false, but {engine.name} is always "
                            "served with its determinism settings; set it to true")
    host, port = _listen(execution["base_url"])
    name = served_name or execution.get("model") or data["model"]["source"]["repo"]
    offline = data["runtime"]["network_policy"] == "offline_required"
    project = "detinf-" + re.sub(r"[^a-z0-9_-]+", "-", manifest.name.lower()).strip("-")
    service: dict[str, Any] = {
        "image": image,
        "container_name": project,
        "command": engine_command(engine, data, name),
        "environment": {**engine_env(engine, data, offline), "HF_HUB_CACHE": CONTAINER_HF_CACHE},
        "ports": [f"{host}:{port}:{engine.port}"],
        "volumes": [f"{hub_cache_dir(env)}:{CONTAINER_HF_CACHE}:ro"],
        "gpus": str(execution.get("gpus") or "all"),
        "ipc": "host",
        "labels": {"org.detinf.manifest_id": manifest.manifest_id, "org.detinf.engine": engine.name},
    }
    compose = {"name": project, "services": {engine.name: service}}
    return ServePlan(engine.name, image, source, project, execution["base_url"], compose)


def _listen(base_url: str | None) -> tuple[str, int]:
    if not base_url:
        raise WorkflowError("$.runtime.execution.base_url: a GPU backend listens where base_url points; set "
                            "it, e.g. http://127.0.0.1:8000")
    parts = urlsplit(base_url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise WorkflowError(f"$.runtime.execution.base_url: {base_url!r} has a bad port") from None
    host = parts.hostname or "127.0.0.1"
    return ("127.0.0.1" if host == "localhost" else host), port


def repo_digests(inspect_output: str) -> set[str]:
    """The ``sha256:...`` digests in `docker image inspect --format '{{json .RepoDigests}}'` output."""
    try:
        entries = json.loads(inspect_output.strip() or "[]")
    except json.JSONDecodeError:
        return set()
    if not isinstance(entries, list):
        return set()
    return {entry.split("@", 1)[1] for entry in entries if isinstance(entry, str) and "@" in entry}


def verify_local_image(image: str) -> None:
    """Refuse unless the local image's repo digests contain the pinned digest."""
    docker = _docker()
    result = subprocess.run([docker, "image", "inspect", "--format", "{{json .RepoDigests}}", image],
                            capture_output=True, text=True, timeout=120, check=False)
    if result.returncode != 0:
        reason = " ".join(result.stderr.split())[:200] or f"exit {result.returncode}"
        raise WorkflowError(f"image {image}: cannot inspect the local image ({reason}); fetch it with "
                            "`detinf serve --config ... --pull` or `docker pull`")
    expected = image.rsplit("@", 1)[1]
    found = repo_digests(result.stdout)
    if expected not in found:
        raise WorkflowError(f"image {image}: the local image has digests {sorted(found)}, not the pinned "
                            f"{expected}; pull the pinned image (--pull) or fix the pin")


def start(plan: ServePlan, compose_path: Path, pull: bool, command_line: str) -> None:
    """Write the compose file, pull (optional), verify the image, then `docker compose up -d`."""
    docker = _docker()
    compose_path.parent.mkdir(parents=True, exist_ok=True)
    compose_path.write_text(plan.compose_text(command_line), encoding="utf-8")
    if pull:
        _run([docker, "pull", plan.image], "docker pull", DOCKER_TIMEOUT)
    verify_local_image(plan.image)
    _run([docker, "compose", "-f", str(compose_path), "up", "-d"], "docker compose up", 600)


def _docker() -> str:
    docker = shutil.which("docker")
    if docker is None:
        raise WorkflowError("docker: not found on PATH; GPU backends start through docker compose (install "
                            "Docker with the compose plugin), or use backend embedded")
    return docker


def _run(command: list[str], what: str, timeout: int) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        reason = " ".join(result.stderr.split())[:300] or f"exit {result.returncode}"
        raise WorkflowError(f"{what} failed: {reason}")
