"""Helpers for the scale-out tests: bitwise views of API responses, labelled metrics, sharded runs."""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from tests.server.harness import detinf_command
from tests.workflow.helpers import detinf, read_json

SHARD_LINE = re.compile(r"shard (\d+)/(\d+): (\d+) request\(s\) on worker pid (\d+) .* attempt (\d+)")
SHARDED_RUN_TIMEOUT = 600.0
VOLATILE = ("id", "created", "cached_tokens")  # metadata that depends on the request or cache state,
# never part of the output


def bits(value: Any) -> Any:
    """`value` with every float replaced by its float32 bit pattern (hex), and volatile fields dropped: equal
    results mean bitwise-equal logprobs (-0.0 and 0.0 differ here)."""
    if isinstance(value, float):
        return "f32:" + struct.pack("<f", value).hex()
    if isinstance(value, dict):
        return {key: bits(item) for key, item in value.items() if key not in VOLATILE}
    if isinstance(value, list):
        return [bits(item) for item in value]
    return value


def sse_documents(text: str) -> list[Any]:
    """The JSON documents of an SSE body (without the final [DONE])."""
    documents = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            documents.append(json.loads(line[len("data: "):]))
    return documents


def fold_stream(documents: list[Any]) -> dict[str, Any]:
    """A stream's chunks folded per choice (strings concatenated, lists extended): what the stream says,
    independent of where the chunk boundaries fell (they depend on timing, the content does not)."""
    folded: dict[str, Any] = {"choices": {}, "system_fingerprints": sorted(
        {str(doc.get("system_fingerprint")) for doc in documents})}
    for doc in documents:
        for choice in doc.get("choices", []):
            _accumulate(folded["choices"].setdefault(choice["index"], {}), choice)
    return folded


def _accumulate(into: dict[str, Any], piece: dict[str, Any]) -> None:
    for key, value in piece.items():
        if value is None:
            continue
        if isinstance(value, dict):
            _accumulate(into.setdefault(key, {}), value)
        elif isinstance(value, str | list) and key in into and into[key] is not None:
            into[key] = into[key] + value
        else:
            into[key] = value


def labelled_metric(base_url: str, name: str, labels: dict[str, str], headers: dict[str, str] | None = None
                    ) -> float:
    """Value of the sample `name{labels...}` (labels matched as a subset) from GET /metrics; 0 if absent."""
    text = httpx.get(base_url + "/metrics", headers=headers or {}, timeout=30).text
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{key}="{val}"' in head for key, val in labels.items()):
            return float(value)
    return 0.0


def run_sharded(manifest: Path, target: Path, address: str, kill_attempts: dict[int, int],
                env: dict[str, str] | None = None) -> tuple[int, str]:
    """`detinf run --ray-address ADDR --shards 2` in a subprocess (environment `env`, default this
    process's); SIGKILL the worker of shard i at its attempts listed in `kill_attempts` (shard -> how
    many attempts to kill) as soon as it is announced. Returns the exit code and the output."""
    command = [*detinf_command(), "run", "--config", str(manifest), "--output-dir", str(target),
               "--ray-address", address, "--shards", "2"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               cwd=Path(__file__).resolve().parents[2], env=env)
    lines = []
    deadline = time.monotonic() + SHARDED_RUN_TIMEOUT
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line)
        match = SHARD_LINE.search(line)
        if match and int(match.group(5)) <= kill_attempts.get(int(match.group(1)), 0):
            os.kill(int(match.group(4)), signal.SIGKILL)
        if time.monotonic() > deadline:
            process.kill()
            break
    return process.wait(timeout=60), "".join(lines)


def check_conformant(reference: Path, sharded: Path, report_dir: Path) -> None:
    """`detinf verify` grades the two runs conformant and their outputs are the same bytes."""
    result = detinf("verify", "--bundle-a", reference, "--bundle-b", sharded, "--output-dir", report_dir)
    assert result.code == 0 and "grade: conformant" in result.out, result.out + result.err
    for name in ("tokens.json", "captures/logits.json", "captures/activations.json", "requests.json"):
        assert (reference / name).read_bytes() == (sharded / name).read_bytes(), name
    bundle_a, bundle_b = read_json(reference / "bundle.json"), read_json(sharded / "bundle.json")
    assert bundle_a["run_id"] == bundle_b["run_id"] and bundle_a["fingerprint"] == bundle_b["fingerprint"]
