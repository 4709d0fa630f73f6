"""`detinf serve --config MANIFEST`: serves what the manifest pins, after the run's checks."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx

from tests.server.harness import detinf_command, free_port, subprocess_server
from tests.workflow.helpers import detinf, edit_manifest, read_json


def test_serve_config_refuses_a_tampered_weight(tiny_manifest: Path, tiny_model_copy: Path) -> None:
    weights = tiny_model_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x00")
    command = [*detinf_command(), "serve", "--port", str(free_port()), "--config", str(tiny_manifest)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2 and str(weights) in done.stderr and done.stderr.count("sha256:") == 2


def test_serve_config_refuses_numerics_it_cannot_serve(tiny_manifest: Path) -> None:
    edit_manifest(tiny_manifest, {"engine": {"kv_block_size": 32}})
    assert detinf("lock", "--config", tiny_manifest).code == 0
    command = [*detinf_command(), "serve", "--port", str(free_port()), "--config", str(tiny_manifest)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2 and "$.engine.kv_block_size" in done.stderr


def test_served_engine_matches_the_run_fingerprint(tiny_manifest: Path, tmp_path: Path) -> None:
    assert detinf("run", "--config", tiny_manifest, "--output-dir", tmp_path / "embedded").code == 0
    run_fingerprint = read_json(tmp_path / "embedded" / "bundle.json")["system_fingerprint"]
    with subprocess_server(["--config", str(tiny_manifest), "--served-model-name", "tiny"]) as (server, _):
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
        response = httpx.post(server.v1 + "/completions", json=body, timeout=60).json()
        assert response["system_fingerprint"] == run_fingerprint
        over_http = detinf("run", "--config", tiny_manifest, "--base-url", server.base_url,
                           "--output-dir", tmp_path / "http")
        assert over_http.code == 0, over_http.err
    assert read_json(tmp_path / "http" / "bundle.json")["system_fingerprint"] == run_fingerprint
    embedded = read_json(tmp_path / "embedded" / "tokens.json")["sequences"]
    served = read_json(tmp_path / "http" / "tokens.json")["sequences"]
    assert [s["text"] for s in served] == [s["text"] for s in embedded]
