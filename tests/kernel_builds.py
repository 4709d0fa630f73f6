"""Kernel builds that tests need, compiled together.

Each `native_build.build` runs one compiler per source, but one source can take most of a build's time
(attention_tile.c at -march=x86-64-v3), leaving the other CPUs idle while it compiles. Building every
variant a test module needs at the same time fills those CPUs with the other variants' sources, so the
wall time is about the sum of the builds' CPU time over the CPUs instead of the sum of their slowest
sources. The builds are the package's own (same cache keys), so nothing built here is ever stale.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from deterministic_inference.ops.native_build import build

Build = tuple[tuple[str, ...], Path | None]  # (flags, directory; None = the kernel cache $DETINF_CACHE_DIR)


def build_together(builds: Sequence[Build]) -> list[Path]:
    """`build(flags, directory)` for every build at once (cached ones return at once); the libraries'
    paths in the same order."""
    with ThreadPoolExecutor(max_workers=max(1, len(builds)), thread_name_prefix="detinf-build") as pool:
        return list(pool.map(lambda item: build(*item), builds))
