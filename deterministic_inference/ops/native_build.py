"""Building the compiled kernels (ops/csrc/*.c; loaded by ops/native.py) with the system C compiler on
first use, for the -march that $DETINF_KERNEL_MARCH names (native by default).

The shared library is cached under `$DETINF_CACHE_DIR` (default `~/.cache/deterministic-inference`)
in a file named by the sha256 of the source, the flags and the compiler's version, so a change to any
of them builds a new library and never reuses a stale one. Builds go to a temporary name and are
renamed into place, so processes building at the same time cannot load a half-written file.

Each source is compiled to an object file by its own compiler process, up to one per CPU this process
may run on, the slowest sources first; then one link. The compiler compiles every source on its own
whether it is given one or all of them, so the library is the one a single `cc a.c b.c ...` makes.
Object files are kept too (`objects` beside the libraries), keyed by the preprocessed source, so builds
that differ only in what some sources see recompile only those sources.

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
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from deterministic_inference.errors import DetinfError

_CSRC = Path(__file__).parent / "csrc"
_QUANT = (  # ops/quant.py, ops/repack.py
    "act", "unpack", "unpack512", "gemv512", "kernels", "kernels256", "amx", "gemm", "convert", "repack",
    "tiles",
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
    _CSRC / "portable_math.h", _CSRC / "gemm_fma.h", _CSRC / "gemm_amx.h", _CSRC / "gemm_amx_chunked.h",
    _CSRC / "gemm_amx_quant.h", _CSRC / "kv_q8.h",
)  # fmt: skip
# -fopenmp: rows are shared out between OpenMP threads. torch is imported first and has loaded its own
# libgomp.so.1, which the kernels' libgomp.so.1 dependency then resolves to: one thread pool, sized by
# torch.set_num_threads.
_FLOAT_FLAGS = ("-fno-fast-math", "-ffp-contract=off", "-fno-math-errno")
BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-std=c11", "-fopenmp", *_FLOAT_FLAGS)
_LINK_ONLY_FLAGS = ("-shared",)
# Compiled first: together about 80% of a build's compiler time (bench/bench_kernel_build.py; their
# AVX-512 code at -march=native), so starting them last would leave one compiler running alone at the end.
_SLOWEST_SOURCES = ("quant_gemv512.c", "attention_tile.c")
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


def build(isa_flags: tuple[str, ...] = ISA_FLAGS, directory: Path | None = None, jobs: int | None = None
          ) -> Path:
    """Compile the kernel (or find the cached build) and return the library's path. `jobs`: compiler
    processes at once (default: the CPUs this process may run on)."""
    cc = compiler()
    target = library_path(cc, isa_flags, directory)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    flags = (*BASE_FLAGS, *isa_flags)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        objects = _compile_objects(cc, flags, Path(work), jobs or available_cpus())
        partial = Path(work) / target.name
        _run_compiler(cc, link_command(cc, flags, objects, partial))
        os.replace(partial, target)
    return target


def library_path(cc: str, isa_flags: tuple[str, ...], directory: Path | None = None) -> Path:
    """Where the build for these flags with compiler `cc` is cached: named by the sha256 of the sources,
    the flags and the compiler's version."""
    version = _compiler_version(cc)
    flags = (*BASE_FLAGS, *isa_flags)
    digest = hashlib.sha256(_source_bytes() + "\0".join((*flags, version)).encode()).hexdigest()[:16]
    return (directory or cache_dir()) / f"attention-{digest}.so"


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask), at least 1."""
    affinity = getattr(os, "sched_getaffinity", None)
    return max(1, len(affinity(0)) if affinity is not None else os.cpu_count() or 1)


def _compile_objects(cc: str, flags: Sequence[str], work: Path, jobs: int) -> list[Path]:
    """Every source to an object file, `jobs` compiler processes at once (the slowest sources first, then
    the largest, so no long compile starts last); the objects in SOURCES order. An object whose
    preprocessed source and flags were compiled before comes from the object cache (`_cached_object`)."""
    objects = [work / f"{index:02d}-{source.stem}.o" for index, source in enumerate(SOURCES)]

    order = sorted(range(len(SOURCES)), key=compile_priority)
    version = _compiler_version(cc)  # once per build, not once per source

    def compile_one(index: int) -> None:
        cached = _cached_object(cc, version, flags, SOURCES[index])
        if not cached.exists():
            partial = work / f"{index:02d}-{cached.name}"
            _run_compiler(cc, compile_command(cc, flags, SOURCES[index], partial))
            cached.parent.mkdir(parents=True, exist_ok=True)
            os.replace(partial, cached)
        shutil.copyfile(cached, objects[index])

    with ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="detinf-cc") as pool:
        futures = [pool.submit(compile_one, index) for index in order]
        for future in futures:
            error = future.exception()
            if error is not None:
                pool.shutdown(wait=True, cancel_futures=True)
                raise error
    return objects


def _cached_object(cc: str, version: str, flags: Sequence[str], source: Path) -> Path:
    """Where the object file of `source` compiled with `flags` is kept: named by the sha256 of the source
    as the preprocessor expands it (headers, -D defines and the ISA's predefined macros included), the
    flags that act after preprocessing, and the compiler's `version` (`_compiler_version`). A build
    differing from another only in a -D that few sources read (the test-only builds) recompiles only
    those; a changed header recompiles the sources that include it."""
    compile_flags = [flag for flag in flags if flag not in _LINK_ONLY_FLAGS]
    expanded = _run_compiler(cc, [cc, *compile_flags, f"-I{_CSRC}", "-E", str(source)])
    after_preprocessing = [flag for flag in compile_flags if not flag.startswith(("-D", "-U", "-I"))]
    key = b"\0".join((expanded, "\0".join((*after_preprocessing, version)).encode()))
    return cache_dir().parent / "objects" / f"{source.stem}-{hashlib.sha256(key).hexdigest()[:20]}.o"


def _compiler_version(cc: str) -> str:
    """What `cc --version` prints: part of every cache key, so another compiler never reuses a build."""
    return subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout


def compile_priority(index: int) -> tuple[bool, int]:
    """Sort key of SOURCES[index] in a build's compile order: the slowest sources, then the largest."""
    source = SOURCES[index]
    return source.name not in _SLOWEST_SOURCES, -source.stat().st_size


def compile_command(cc: str, flags: Sequence[str], source: Path, output: Path) -> list[str]:
    """The command compiling one source of the library to an object file."""
    compile_flags = [flag for flag in flags if flag not in _LINK_ONLY_FLAGS]
    return [cc, *compile_flags, f"-I{_CSRC}", "-c", str(source), "-o", str(output)]


def link_command(cc: str, flags: Sequence[str], objects: Sequence[Path], output: Path) -> list[str]:
    """The command linking the object files (in SOURCES order) into the shared library."""
    return [cc, *flags, *map(str, objects), "-o", str(output), "-lm"]


def _run_compiler(cc: str, command: list[str]) -> bytes:
    """Run one compiler command and return its standard output; NativeBuildError with its first line of
    errors when it fails."""
    result = subprocess.run(command, capture_output=True, check=False)
    if result.returncode != 0:
        first_line = (result.stderr.decode(errors="replace").strip().splitlines() or ["(no output)"])[0]
        raise NativeBuildError(
            f"building the C kernels with {cc} failed: {first_line}; fix the compiler (or set CC to a "
            "working one), or run with --no-batch-invariant"
        )
    return result.stdout


def isa_flags() -> tuple[str, ...]:
    """The -march flag from $DETINF_KERNEL_MARCH (native | x86-64-v3 | x86-64; default native)."""
    march = os.environ.get(MARCH_ENV) or "native"
    if march not in MARCHES:
        raise NativeBuildError(
            f"{MARCH_ENV}: {march!r} is not one of {', '.join(MARCHES)}; unset it to build for this CPU"
        )
    return (f"-march={march}",)
