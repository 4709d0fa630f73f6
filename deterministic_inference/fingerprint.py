"""Determinism fingerprint: what can change output bits, and what is only recorded.

Outputs are promised bitwise equal only for an equal fingerprint. It has two parts:

- what can change bits (`bits_part`): the model digest, the engine numerics (dtype, kernels' sources
  digest, ops revision, weight formats, `portable`), the digest of the software closure, and — only
  where a non-portable path is in use (`numerics.portable` false) — the ISA: the numerics then carry
  `isa` (CPU features and torch's dispatch) and the hardware digest counts too;
- what is informational (`informational`): the hardware class (CPU model, vendor, ISA flags) and the
  ISA selection of this process (torch's dispatch level, the kernel-selecting environment, the kernels'
  -march). In portable numerics (invariant mode: every rounding operation in our kernels, whose bits
  are fixed by their source) none of these can change a bit, so two CPUs share one fingerprint.

- `hardware_fingerprint()`: the hardware *class* — architecture, CPU vendor, model name and ISA
  features. Core counts, MHz, caches and steppings are left out.
- `software_closure()`: Python, torch (version, build-config digest, MKL / oneDNN versions), this
  package's version and every installed distribution with its version. Thread settings are NOT in it.
- `isa_selection()`: torch's dispatch level, the environment variables that select torch / MKL /
  oneDNN kernels, the kernels' -march.
- `engine_fingerprint(model_digest, numerics, portable)`: both parts; `system_fingerprint()` is the
  short string of the bits part, returned as `system_fingerprint` in API responses.

Every function computes afresh (nothing is cached); call them once per engine.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
from collections.abc import Mapping
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


def software_closure() -> dict[str, Any]:
    """The software that determines output bits (see the module docstring)."""
    import torch

    from deterministic_inference import __version__

    # torch's build description names the dispatch level of this process: that line is ISA selection
    config_text = re.sub(r"(?m)^.*CPU capability usage:.*$", "", torch.__config__.show())
    return {
        "python": {"implementation": platform.python_implementation(), "version": platform.python_version()},
        "torch": {
            "version": torch.__version__,
            "build_config_digest": "sha256:" + sha256_hex(config_text.encode("utf-8")),
            "mkl": _search(r"Math Kernel Library Version ([^\s]+)", config_text),
            "onednn": _search(r"MKL-DNN v([^\s]+)", config_text),
        },
        "deterministic_inference": __version__,
        "distributions": installed_distributions(),
    }


def isa_selection(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Which ISA this process computes with: torch's dispatch level (ATEN_CPU_CAPABILITY), the
    kernel-selecting environment variables (never thread counts) and the kernels' -march
    ($DETINF_KERNEL_MARCH). Informational in portable numerics; part of the numerics otherwise."""
    import torch

    from deterministic_inference.ops.native_build import MARCH_ENV

    env = dict(os.environ) if environ is None else environ
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "env": {name: env[name] for name in NUMERIC_ENV_VARS if name in env},
        "kernel_march": env.get(MARCH_ENV) or "native",
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


def engine_fingerprint(model_digest: str, numerics: dict[str, Any], portable: bool) -> dict[str, Any]:
    """The engine's fingerprint: model digest, numerics (with `portable`, and the ISA when not portable),
    software closure digest, hardware digest, and the informational details (module docstring)."""
    hardware, selection = hardware_fingerprint(), isa_selection()
    numerics = dict(numerics, portable=portable)
    if not portable:
        numerics["isa"] = {"cpu": hardware["isa"], "selection": selection}
    return {
        "model": model_digest,
        "numerics": numerics,
        "software": digest(software_closure()),
        "hardware": digest(hardware),  # counts only when numerics.portable is false
        "informational": {"hardware": hardware, "isa_selection": selection},
    }


def is_portable(fp: dict[str, Any]) -> bool:
    """True when the fingerprint's numerics are portable (older records without the flag: False)."""
    numerics = fp.get("numerics")
    return isinstance(numerics, dict) and numerics.get("portable") is True


def bits_part(fp: dict[str, Any]) -> dict[str, Any]:
    """The part of a fingerprint that can change output bits: model, numerics, software, and the
    hardware digest unless the numerics are portable."""
    part = {key: fp.get(key) for key in ("model", "numerics", "software")}
    if not is_portable(fp):
        part["hardware"] = fp.get("hardware")
    return part


def system_fingerprint(fp: dict[str, Any]) -> str:
    """Short id of a fingerprint's bits part: ``detinf-`` + 16 hex digits of the sha256 of its canonical
    JSON (equal on two CPUs when the numerics are portable)."""
    return "detinf-" + sha256_hex(canonical_bytes(bits_part(fp)))[:16]


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
