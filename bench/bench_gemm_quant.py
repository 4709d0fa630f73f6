"""The quantized GEMM at the shapes of issue 36: the 1B Llama maker file's (Q4_0) and the default model's
(SmolLM2-135M, Q4_1), at decode (1, 32 rows) and prefill-chunk (128, 512 rows) row counts, each weight
repacked as the engine repacks it.

Run by hand from the repository root (not a test):
    .venv/bin/python -m bench.bench_gemm_quant [--rows 1 32 128 512] [--threads 1 2] [--rounds 7]
        [--base-lib PATH]
Columns: this tree's kernels (the AMX-INT8 tiles where the CPU has them), the same build's VNNI tiles
(TEST_NO_AMX) and, with --base-lib, another build of the kernels (e.g. the library another tree's
`python -c "from deterministic_inference.ops.native_build import build; print(build())"` prints). Rounds are
interleaved and the best of each kept, so read the ratios: absolute times move with the machine's load. At one
thread the times are the thread's CPU time (the machine is shared), at more the wall clock.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from deterministic_inference.ops.native import NativeKernels, load, native_kernels
from deterministic_inference.ops.quant import TEST_NO_AMX, QuantLinear
from deterministic_inference.ops.quant_probe import random_weight

# (format, name, N, K): Llama-3.2-1B shapes (qkv, gate_up, down; gate_up, down in Q4_K_M's K formats, gate_up
# in Q5_K_M's) and
# SmolLM2-135M's (q+k+v, gate+up, down, o, the Q8_0 logits head)
SHAPES = (
    ("Q4_0", "1B qkv", 3072, 2048),
    ("Q4_0", "1B gate_up", 16384, 2048),
    ("Q4_0", "1B down", 2048, 8192),
    ("Q4_K", "1B gate_up K", 16384, 2048),
    ("Q5_K", "1B gate_up K5", 16384, 2048),
    ("Q6_K", "1B down K", 2048, 8192),
    ("Q4_1", "135M qkv", 960, 576),
    ("Q4_1", "135M gate_up", 3072, 576),
    ("Q4_1", "135M down", 576, 1536),
    ("Q4_1", "135M o", 576, 576),
    ("Q8_0", "135M logits", 49152, 576),
)


def _calls(
    libs: dict[str, NativeKernels], fmt: str, n: int, k: int, x: torch.Tensor, seed: int
) -> dict[str, Callable[[], object]]:
    """One call per column, every library on the same random weight (its own repacked copy)."""
    fns: dict[str, Callable[[], object]] = {}
    for name, lib in libs.items():
        weight = random_weight(fmt, n, k, torch.Generator().manual_seed(seed))
        linear = QuantLinear(lib, [weight], bias=None, out_dtype=torch.bfloat16)
        fns[name] = functools.partial(linear.forward_with_flags, x, 0)
        if name == "ours":
            fns["ours vnni"] = functools.partial(linear.forward_with_flags, x, TEST_NO_AMX)
    return fns


# Written over before every timed call, so that each call finds its weight in memory, not in the last-level
# cache (larger than any L3 here), as in the engine, whose weights stream from memory every step. Without it
# a column ran on a weight another column had just brought into L3 (the 1B gate_up, 19 MB, fits a 32 MB
# L3): the same library measured as "base" came out 1.03-1.6x slower than as "ours" (AMD Zen 4, 1-27 rows).
EVICT_BYTES = 256 << 20


def best_cpu_times(
    fns: Mapping[str, Callable[[], object]], rounds: int, clock: Callable[[], float]
) -> dict[str, float]:
    """Best-of-`rounds` ms per call, variants interleaved round by round, each call after the caches are
    written over (EVICT_BYTES), on `clock`: this thread's CPU time at one thread (time the scheduler gives
    another process is not counted: the machine is shared), the wall clock at more."""
    best = {name: float("inf") for name in fns}
    scratch = torch.zeros(EVICT_BYTES, dtype=torch.uint8)
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(rounds):
        for name, fn in fns.items():
            scratch.add_(1)
            start = clock()
            fn()
            best[name] = min(best[name], (clock() - start) * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 128, 512])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--shapes", nargs="+", help="names of SHAPES to run (default: all)")
    parser.add_argument("--base-lib", type=Path, help="another build of the kernels to compare against")
    args = parser.parse_args()
    libs = {"ours": native_kernels()}
    if args.base_lib:
        libs["base"] = load(args.base_lib)
    columns = ["ours", "ours vnni", *(["base"] if args.base_lib else [])]
    base_ratio = " | base / ours" if args.base_lib else ""
    header = " | ".join(f"{c} ms" for c in columns)
    print(f"| threads | weight | M | {header} | ours G MAC/s | vnni / ours{base_ratio} |")
    print("|---|---|---|" + "---|" * (len(columns) + 2 + bool(args.base_lib)))
    for threads in args.threads:
        torch.set_num_threads(threads)
        for seed, (fmt, name, n, k) in enumerate(SHAPES):
            if args.shapes and name not in args.shapes:
                continue
            for m in args.rows:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
                clock = time.thread_time if threads == 1 else time.perf_counter
                times = best_cpu_times(_calls(libs, fmt, n, k, x, seed), args.rounds, clock)
                cells = " | ".join(f"{times[c]:.3f}" for c in columns)
                rate = m * n * k / times["ours"] / 1e6
                extra = f" | {times['base'] / times['ours']:.2f}x" if args.base_lib else ""
                print(
                    f"| {threads} | {fmt} {name} {n}x{k} | {m} | {cells} | {rate:.0f} | "
                    f"{times['ours vnni'] / times['ours']:.2f}x{extra} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
