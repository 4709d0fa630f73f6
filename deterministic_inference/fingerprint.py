"""Determinism fingerprint: hardware class, software closure and the engine fingerprint built on them.

Outputs are promised bitwise equal only for an equal fingerprint:

- `hardware_fingerprint()`: the hardware *class* — architecture, CPU vendor, model name and the ISA
  features that select GEMM / vector kernels. Core counts, MHz, caches and steppings are left out: they
  do not change the bits.
- `software_closure()`: Python, torch (version, build-config digest, MKL / oneDNN versions, the ISA level
  ATen dispatches to), this package's version, every installed distribution with its version, and the
  environment variables that change kernel selection. Thread settings are NOT in it: the contract says
  outputs do not depend on them.
- `engine_fingerprint(model_digest, numerics)`: the four parts the engine reports; its
  `system_fingerprint()` is the short string returned as `system_fingerprint` in API responses.

Every function computes afresh (nothing is cached); call them once per engine.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
from pathlib import Path
from typing import Any

from deterministic_inference.workflow.canonical import canonical_bytes, digest_json, sha256_hex

CPUINFO = Path("/proc/cpuinfo")
# ISA features that change which GEMM / vector kernels MKL, oneDNN and ATen pick.
X86_FEATURES = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni",
    "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8",
)
ARM_FEATURES = ("asimd", "asimdhp", "fphp", "sve", "sve2", "bf16", "i8mm", "sme")
# Environment variables that select kernels or numeric modes (never thread counts).
NUMERIC_ENV_VARS = (
    "ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "MKL_DEBUG_CPU_TYPE", "DNNL_MAX_CPU_ISA",
    "ONEDNN_MAX_CPU_ISA", "DNNL_DEFAULT_FPMATH_MODE", "ONEDNN_DEFAULT_FPMATH_MODE",
    "TORCH_MKLDNN_MATMUL_MIN_DIM",
)


def digest(obj: Any) -> str:
    """``sha256:<hex>`` of the canonical JSON of `obj`."""
    return digest_json(obj)


def hardware_fingerprint(cpuinfo_text: str | None = None) -> dict[str, Any]:
    """The hardware class of this machine (or of the given /proc/cpuinfo text)."""
    text = cpuinfo_text if cpuinfo_text is not None else _read_cpuinfo()
    fields = _first_processor_fields(text)
    arch = platform.machine().lower() or "unknown"
    flag_text = fields.get("flags") or fields.get("features") or ""
    flags = set(flag_text.split())
    feature_names = ARM_FEATURES if arch in ("aarch64", "arm64") else X86_FEATURES
    vendor = fields.get("vendor_id") or fields.get("cpu implementer") or platform.processor() or "unknown"
    model_name = fields.get("model name") or fields.get("cpu part") or "unknown"
    return {
        "arch": arch,
        "vendor": vendor.strip(),
        "model_name": " ".join(model_name.split()),
        "isa": {name: name in flags for name in feature_names},
    }


def software_closure(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The software that determines output bits; `environ` defaults to the process environment."""
    import torch

    from deterministic_inference import __version__

    env = dict(os.environ) if environ is None else environ
    config_text = torch.__config__.show()
    return {
        "python": {"implementation": platform.python_implementation(), "version": platform.python_version()},
        "torch": {
            "version": torch.__version__,
            "build_config_digest": "sha256:" + sha256_hex(config_text.encode("utf-8")),
            "mkl": _search(r"Math Kernel Library Version ([^\s]+)", config_text),
            "onednn": _search(r"MKL-DNN v([^\s]+)", config_text),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        },
        "deterministic_inference": __version__,
        "distributions": installed_distributions(),
        "env": {name: env[name] for name in NUMERIC_ENV_VARS if name in env},
    }


def installed_distributions() -> list[list[str]]:
    """Sorted ``[normalized name, version]`` pairs of every installed distribution (duplicates dropped).

    Import-path entries *inside* an installed package (Ray puts ``ray/thirdparty_files`` with its vendored
    psutil and colorama on ``sys.path`` when imported) are skipped: they say what a library imported,
    not what is installed, and would make a Ray worker's closure differ from a plain process's."""
    pairs: set[tuple[str, str]] = set()
    for dist in importlib.metadata.distributions(path=_installation_paths()):
        name = dist.metadata["Name"] if dist.metadata else None
        if name:
            pairs.add((re.sub(r"[-_.]+", "-", str(name)).lower(), str(dist.version)))
    return [list(pair) for pair in sorted(pairs)]


def _installation_paths() -> list[str]:
    """sys.path without the entries nested inside another entry that is a site directory."""
    import site
    import sys

    roots = {os.path.abspath(p) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    kept = []
    for entry in sys.path:
        full = os.path.abspath(entry) if entry else os.getcwd()
        if not any(full != root and full.startswith(root + os.sep) for root in roots):
            kept.append(entry)
    return kept


def engine_fingerprint(model_digest: str, numerics: dict[str, Any]) -> dict[str, Any]:
    """The engine's fingerprint: model digest, numerics, and digests of software closure and hardware."""
    return {
        "model": model_digest,
        "numerics": dict(numerics),
        "software": digest(software_closure()),
        "hardware": digest(hardware_fingerprint()),
    }


def system_fingerprint(fp: dict[str, Any]) -> str:
    """Short id of a fingerprint: ``detinf-`` + 16 hex digits of the sha256 of its canonical JSON."""
    return "detinf-" + sha256_hex(canonical_bytes(fp))[:16]


def _read_cpuinfo() -> str:
    try:
        return CPUINFO.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _first_processor_fields(text: str) -> dict[str, str]:
    """Key/value pairs of the first processor block (keys lower-cased)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
    return fields


def _search(pattern: str, text: str) -> str | None:
    match = re.search(pattern, text)
    return match.group(1) if match else None
