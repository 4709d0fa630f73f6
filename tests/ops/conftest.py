"""The kernel builds the compiled-kernel tests compare, each built at most once per test run.

Every build here tests something the others do not:

- `-march=native` (`kernels`): the build the engine runs on this CPU (its AVX-512 / VNNI / BF16 / AMX
  paths where the CPU has them).
- `-march=x86-64-v3` (`march_builds`): AVX2 + FMA without AVX-512: the 256-bit paths and the fmaf bf16
  GEMM give native's bits.
- `-march=x86-64` (`march_builds`): SSE2 only, no FMA (libm's fmaf): the scalar C paths give native's
  bits.
- `-DDETINF_TEST_SEPARATE_STEPS` (`flagged_build`): negative control: the build comparisons see an exp
  that rounds product and sum apart.
- `-ffp-contract=fast` (`flagged_build`): negative control: they see contraction into FMA (what
  -ffp-contract=off forbids).

The two perturbations cannot share one build: contraction would fuse the separate steps back into FMA.
The four builds besides native compile together (tests/kernel_builds.py says why).

The package's own builds (-march levels) come from the kernel cache the engine uses (`$DETINF_CACHE_DIR`,
default `~/.cache/deterministic-inference`), where `scripts/setup.sh` built the native one and the engine
tests' subprocesses (DETINF_KERNEL_MARCH) find the others: the cache is keyed by the sources, the flags
and the compiler's version, so a cached build is never stale and each is compiled once. Test-only
builds (-D test hooks, other float flags) go to a directory of their own beside that cache (`build_dir`),
keyed the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from deterministic_inference.ops.native import NativeKernels, load
from deterministic_inference.ops.native_build import ISA_FLAGS, build, cache_dir
from tests.kernel_builds import Build, build_together

MARCH_LEVELS = ("x86-64-v3", "x86-64")
TEST_ONLY_FLAGS = ("-DDETINF_TEST_SEPARATE_STEPS", "-ffp-contract=fast")


@pytest.fixture(scope="session")
def build_dir() -> Path:
    """The directory of test-only builds: `test-builds` beside the kernel cache, never in it (the engine
    never loads from here). Keyed like the cache (sources, flags, compiler version), so a build here is
    never stale and is made once for all runs and for every pytest-xdist worker of a run."""
    return cache_dir().parent / "test-builds"


@pytest.fixture(scope="session")
def kernels() -> NativeKernels:
    """The default build (ISA_FLAGS, i.e. -march=native), the engine's, from the kernel cache."""
    return load(build(ISA_FLAGS))


@pytest.fixture(scope="session")
def amx(kernels: NativeKernels) -> NativeKernels:
    """The engine's build, when this process can run its AMX-BF16 GEMM (`--numerics native`); else the
    test skips."""
    missing = kernels.native_gemm_missing()
    if missing is not None:
        pytest.skip(f"no AMX-BF16 GEMM here: {missing}")
    return kernels


@pytest.fixture(scope="session")
def variants(build_dir: Path) -> dict[str, NativeKernels]:
    """Every build below but native, built together (tests/kernel_builds.py) once per session, by -march
    level or test-only flag."""
    builds: dict[str, Build] = {march: ((f"-march={march}",), None) for march in MARCH_LEVELS}
    builds.update({flag: ((*ISA_FLAGS, flag), build_dir) for flag in TEST_ONLY_FLAGS})
    paths = build_together(list(builds.values()))
    return {key: load(path) for key, path in zip(builds, paths, strict=True)}


@pytest.fixture(scope="session")
def march_builds(variants: dict[str, NativeKernels]) -> dict[str, NativeKernels]:
    """The package's builds for the older x86-64 levels (MARCH_LEVELS), from the kernel cache."""
    return {march: variants[march] for march in MARCH_LEVELS}


@pytest.fixture(scope="session")
def flagged_build(variants: dict[str, NativeKernels]) -> Callable[[str], NativeKernels]:
    """`flagged_build(flag)`: the native build plus one of TEST_ONLY_FLAGS, from the session's directory."""
    return variants.__getitem__
