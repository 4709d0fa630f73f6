"""Cold build time of the C kernels (ops/csrc), three ways, each into a fresh directory:

- `one cc`: one compiler invocation for every source (how `native_build.build` worked before issue 37);
- `serial`: one compiler process per source, one at a time (each source's CPU time reported, and the
  wall time `build` would take on `--jobs` idle CPUs: those times scheduled as it schedules them);
- `parallel`: `native_build.build`, one compiler process per source, up to the CPUs this process may run on.

Reports wall seconds and CPU seconds (the compilers' user + sys), and checks that the three libraries are
byte-identical (the parallel build must be the same library, not only as fast). On a shared machine the
wall times include other jobs' load (the load average is printed); the CPU seconds do not.

    .venv/bin/python -m bench.bench_kernel_build [--march native x86-64-v3 x86-64] [--jobs N]
        [--ways one serial parallel] [--test-run]

`--test-run` times instead every build a test run makes after `scripts/setup.sh`: setup's native build,
then the tests' builds (the -march levels, the negative-control and FMA-GEMM test-only builds), made
together as the tests make them. Every build starts from an empty kernel cache and object cache
($DETINF_CACHE_DIR is set to a fresh directory).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from deterministic_inference.ops import native_build

WAYS = ["one", "serial", "parallel"]


def children_cpu() -> float:
    """CPU seconds (user + sys) of the finished child processes so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measured(work: Callable[[], Path]) -> tuple[float, float, str]:
    """(wall s, CPU s, sha256 of the library) of one build."""
    cpu, start = children_cpu(), time.perf_counter()
    library = work()
    wall = time.perf_counter() - start
    return wall, children_cpu() - cpu, hashlib.sha256(library.read_bytes()).hexdigest()[:16]


def one_invocation(cc: str, flags: tuple[str, ...], out: Path) -> Path:
    """The pre-issue-37 build: every source in one compiler command."""
    library = out / "one.so"
    sources = [str(path) for path in native_build.SOURCES]
    command = [cc, *flags, f"-I{native_build.SOURCES[0].parent}", *sources, "-o", str(library), "-lm"]
    subprocess.run(command, check=True, capture_output=True)
    return library


def serial(cc: str, flags: tuple[str, ...], out: Path, per_source: dict[str, float]) -> Path:
    """One compiler process per source, one after the other; each source's CPU seconds into `per_source`."""
    objects = []
    for index, source in enumerate(native_build.SOURCES):
        obj = out / f"{index:02d}-{source.stem}.o"
        before = children_cpu()
        subprocess.run(native_build.compile_command(cc, flags, source, obj), check=True, capture_output=True)
        per_source[source.name] = children_cpu() - before
        objects.append(obj)
    library = out / "serial.so"
    subprocess.run(native_build.link_command(cc, flags, objects, library), check=True, capture_output=True)
    return library


def scheduled_wall(per_source: dict[str, float], jobs: int) -> float:
    """Wall seconds of `jobs` idle CPUs compiling the sources in `build`'s order, each on the first CPU
    to come free (the link not counted)."""
    indices = range(len(native_build.SOURCES))
    order = sorted(indices, key=native_build.compile_priority)
    free_at = [0.0] * jobs
    for index in order:
        cpu = free_at.index(min(free_at))
        free_at[cpu] += per_source[native_build.SOURCES[index].name]
    return max(free_at)


def bench_march(march: str, jobs: int, ways: list[str]) -> None:
    cc = native_build.compiler()
    isa = (f"-march={march}",)
    flags = (*native_build.BASE_FLAGS, *isa)
    per_source: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="detinf-build-bench-") as root:
        base = Path(root)
        for name in ("one", "serial", "parallel"):
            (base / name).mkdir()
        builds = {
            "one": ("one cc", lambda: one_invocation(cc, flags, base / "one")),
            "serial": ("serial", lambda: serial(cc, flags, base / "serial", per_source)),
            "parallel": (f"parallel ({jobs} jobs)", lambda: native_build.build(isa, base / "parallel", jobs)),
        }
        rows = {builds[way][0]: measured(builds[way][1]) for way in ways}
    print(f"\n-march={march} ({cc}, {len(native_build.SOURCES)} sources)")
    print("| build | wall s | CPU s | library sha256 |\n|---|---|---|---|")
    for name, (wall, cpu, digest) in rows.items():
        print(f"| {name} | {wall:.1f} | {cpu:.1f} | {digest} |")
    print("identical libraries:", len({digest for _, _, digest in rows.values()}) == 1)
    slowest = sorted(per_source.items(), key=lambda item: -item[1])[:5]
    print("slowest sources (CPU s):", ", ".join(f"{name} {sec:.1f}" for name, sec in slowest))
    total = sum(per_source.values())
    for count in sorted({1, 2, jobs}) if per_source else ():
        print(f"compiles on {count} idle CPU(s), build's order: {scheduled_wall(per_source, count):.1f} s "
              f"(of {total:.1f} CPU s)")


def bench_test_run(jobs: int) -> None:
    """Setup's native build, then the tests' builds together (tests/kernel_builds.py), from cold caches."""
    from tests.kernel_builds import build_together
    from tests.ops.conftest import MARCH_LEVELS, TEST_ONLY_FLAGS
    from tests.ops.test_gemm_fma import FMA_DEFINES

    test_dir = native_build.cache_dir().parent / "test-builds"
    builds = [((f"-march={march}",), None) for march in MARCH_LEVELS]
    builds += [((*native_build.ISA_FLAGS, flag), test_dir) for flag in TEST_ONLY_FLAGS]
    builds += [((*native_build.ISA_FLAGS, *defines), test_dir) for defines in FMA_DEFINES.values()]
    setup = measured(lambda: native_build.build(jobs=jobs))
    start, cpu = time.perf_counter(), children_cpu()
    build_together(builds)
    print(f"\n{len(builds)} test builds after setup's native build (cold caches, {jobs} jobs each)")
    print("| step | wall s | CPU s |\n|---|---|---|")
    print(f"| setup: native | {setup[0]:.1f} | {setup[1]:.1f} |")
    print(f"| the tests' builds, together | {time.perf_counter() - start:.1f} | {children_cpu() - cpu:.1f} |")


def main() -> None:
    print("load average:", " ".join(f"{value:.1f}" for value in os.getloadavg()))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--march", nargs="+", default=["native"], choices=native_build.MARCHES)
    parser.add_argument("--jobs", type=int, default=native_build.available_cpus())
    parser.add_argument("--ways", nargs="+", default=WAYS, choices=WAYS, help="which builds to time")
    parser.add_argument("--test-run", action="store_true", help="time the builds of a test run instead")
    args = parser.parse_args()
    # cold object and library caches for every build here (native_build keeps objects beside the cache)
    with tempfile.TemporaryDirectory(prefix="detinf-build-bench-cache-") as cache:
        os.environ["DETINF_CACHE_DIR"] = cache
        if args.test_run:
            bench_test_run(args.jobs)
            return
        for march in args.march:
            bench_march(march, args.jobs, args.ways)


if __name__ == "__main__":
    main()
