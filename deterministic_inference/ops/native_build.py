"""Building the compiled kernels (ops/csrc/*.c; loaded by ops/native.py) with the system C compiler on
first use, for the -march that $DETINF_KERNEL_MARCH names (native by default).

The shared library is cached under `$DETINF_CACHE_DIR` (default `~/.cache/deterministic-inference`)
in a file named by the sha256 of the source, the flags and the compiler's version, so a change to any
of them builds a new library and never reuses a stale one. Builds go to a temporary name and are
renamed into place, so processes building at the same time cannot load a half-written file.

Why the build cannot change bits: the flags forbid reassociation (no -ffast-math) and contraction
(-ffp-contract=off: the compiler fuses no multiply-add the source does not write as fmaf), so every
float operation in the source is one IEEE-rounded operation whether the compiler vectorises it or
not; the ISA flags change speed only. -fno-math-errno lets fmaf vectorise (it never sets errno for
finite inputs anyway). The sources' digest (`source_digest`) goes into the engine fingerprint.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from deterministic_inference.errors import DetinfError

_CSRC = Path(__file__).parent / "csrc"
_QUANT = (  # ops/quant.py, ops/repack.py
    "act", "unpack", "unpack512", "gemv512", "kernels", "kernels256", "amx", "gemm", "convert", "repack"
)  # fmt: skip
QUANT_SOURCES = tuple(_CSRC / f"quant_{name}.c" for name in _QUANT)
# portable numerics (ops/portable.py): the sampler's arithmetic, rotary tables, the fp32 GEMM
PORTABLE_SOURCES = (_CSRC / "sampling.c", _CSRC / "rotary_tables.c", _CSRC / "gemm_f32.c")
_ATTENTION = (_CSRC / "attention.c", _CSRC / "attention_tile.c")
SOURCES = (  # compiled together; decoder.c is the decode fast path (ops/fused.py)
    *_ATTENTION, _CSRC / "rowwise.c", _CSRC / "gemm.c", _CSRC / "moe.c", *QUANT_SOURCES,
    *PORTABLE_SOURCES, _CSRC / "decoder.c",
)  # fmt: skip
# included; part of the digest
HEADERS = (
    _CSRC / "common.h", _CSRC / "attention.h", _CSRC / "quant.h", _CSRC / "quant512.h",
    _CSRC / "portable_math.h", _CSRC / "gemm_fma.h",
)  # fmt: skip
# -fopenmp: rows are shared out between OpenMP threads. torch is imported first and has loaded its own
# libgomp.so.1, which the kernels' libgomp.so.1 dependency then resolves to: one thread pool, sized by
# torch.set_num_threads.
_FLOAT_FLAGS = ("-fno-fast-math", "-ffp-contract=off", "-fno-math-errno")
BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-std=c11", "-fopenmp", *_FLOAT_FLAGS)
ISA_FLAGS = ("-march=native",)
# DETINF_KERNEL_MARCH picks the -march the kernels are built for (speed only: the bits are the same).
MARCH_ENV = "DETINF_KERNEL_MARCH"
MARCHES = ("native", "x86-64-v3", "x86-64")


class NativeBuildError(DetinfError):
    """The C compiler is missing or failed; the message says which and how to fix it."""


def source_digest() -> str:
    """sha256 of the kernels' C sources (first 16 hex digits): the bits depend on the sources alone."""
    return hashlib.sha256(_source_bytes()).hexdigest()[:16]


def _source_bytes() -> bytes:
    return b"\0".join(path.read_bytes() for path in (*SOURCES, *HEADERS))


def cache_dir() -> Path:
    """Where built libraries are kept: $DETINF_CACHE_DIR, else ~/.cache/deterministic-inference."""
    configured = os.environ.get("DETINF_CACHE_DIR")
    base = Path(configured) if configured else Path.home() / ".cache" / "deterministic-inference"
    return base / "native"


def compiler() -> str:
    """The C compiler: $CC, else cc, else gcc. Raises NativeBuildError when none is on PATH."""
    for candidate in (os.environ.get("CC"), "cc", "gcc"):
        if candidate and shutil.which(candidate):
            return candidate
    raise NativeBuildError(
        "no C compiler found for the batch-invariant attention kernel: install gcc (Debian: apt install "
        "gcc) or set CC, or run with --no-batch-invariant"
    )


def build(isa_flags: tuple[str, ...] = ISA_FLAGS, directory: Path | None = None) -> Path:
    """Compile the kernel (or find the cached build) and return the library's path."""
    cc = compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    flags = (*BASE_FLAGS, *isa_flags)
    digest = hashlib.sha256(_source_bytes() + "\0".join((*flags, version)).encode()).hexdigest()[:16]
    target_dir = directory or cache_dir()
    target = target_dir / f"attention-{digest}.so"
    if target.exists():
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target_dir) as work:
        partial = Path(work) / target.name
        result = subprocess.run(
            [cc, *flags, f"-I{_CSRC}", *map(str, SOURCES), "-o", str(partial), "-lm"],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            first_line = (result.stderr.strip().splitlines() or ["(no output)"])[0]
            raise NativeBuildError(
                f"building the C kernels with {cc} failed: {first_line}; fix the compiler (or set CC to a "
                "working one), or run with --no-batch-invariant"
            )
        os.replace(partial, target)
    return target


def isa_flags() -> tuple[str, ...]:
    """The -march flag from $DETINF_KERNEL_MARCH (native | x86-64-v3 | x86-64; default native)."""
    march = os.environ.get(MARCH_ENV) or "native"
    if march not in MARCHES:
        raise NativeBuildError(
            f"{MARCH_ENV}: {march!r} is not one of {', '.join(MARCHES)}; unset it to build for this CPU"
        )
    return (f"-march={march}",)
