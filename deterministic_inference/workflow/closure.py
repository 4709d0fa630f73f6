"""The runtime closure a lock pins and a run records.

It is the software closure of the fingerprint (Python, torch build, this package, every installed
distribution), plus the thread settings and the other environment variables that describe the run, and
an informational part: the ISA selection (torch's dispatch level, the kernel-selecting environment, the
kernels' -march) computed with the manifest's ``runtime.env`` applied. ``software_digest`` (the part
that can change output bits) is what verify grades; the closure's digest (`closure_digest`) covers
everything but the informational part, so a lock made on one CPU matches a run on another: in portable
numerics the ISA cannot change a bit, and where a non-portable path is used the engine fingerprint's
numerics carry the ISA instead.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from deterministic_inference import fingerprint

RECORDED_ENV_VARS = (
    "PYTHONHASHSEED", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "KMP_AFFINITY",
    "OMP_PROC_BIND", "LANG", "LC_ALL", "TZ", "CUDA_VISIBLE_DEVICES",
)


def run_environment(manifest_env: Mapping[str, str], base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The process environment a run sees: `base` (default os.environ) with the manifest's env applied."""
    env = dict(os.environ if base is None else base)
    env.update({str(key): str(value) for key, value in manifest_env.items()})
    return env


def runtime_closure(manifest: dict[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The runtime closure for a resolved manifest (see the module docstring)."""
    env = run_environment(manifest["runtime"]["env"], environ)
    software = fingerprint.software_closure()
    return {
        "software": software,
        "software_digest": fingerprint.digest(software),
        "threads": {
            "torch_threads": manifest["runtime"]["threads"],
            "omp_num_threads": env.get("OMP_NUM_THREADS"),
            "mkl_num_threads": env.get("MKL_NUM_THREADS"),
        },
        "env": {name: env[name] for name in RECORDED_ENV_VARS if name in env},
        "informational": {"isa_selection": fingerprint.isa_selection(env)},
    }


def closure_digest(closure: dict[str, Any]) -> str:
    """Digest of a runtime closure without its informational part."""
    return fingerprint.digest(_graded(closure))


def closure_differences(locked: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable differences between two closures (empty when equal), informational part left out."""
    differences: list[str] = []
    _diff(_graded(locked), _graded(current), "", differences)
    return differences


def _graded(closure: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in closure.items() if key != "informational"}


def _diff(a: Any, b: Any, path: str, out: list[str]) -> None:
    if path.endswith("distributions") and isinstance(a, list) and isinstance(b, list):
        old = {item[0]: item[1] for item in a}
        new = {item[0]: item[1] for item in b}
        for name in sorted(set(old) | set(new)):
            if old.get(name) != new.get(name):
                out.append(f"{path}.{name}: {old.get(name, 'absent')} -> {new.get(name, 'absent')}")
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            _diff(a.get(key), b.get(key), f"{path}.{key}" if path else key, out)
        return
    if a != b:
        out.append(f"{path}: {a!r} -> {b!r}")
