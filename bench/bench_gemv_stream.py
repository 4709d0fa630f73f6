"""A single-stream decode step's GEMVs against the memory's streaming rate: 16 layers of the 1B Llama shapes
(q+k+v 3072 x 2048, o 2048 x 2048, gate+up 16384 x 2048, down 2048 x 8192; each layer its own weights, so
the 547-617 MB stream from memory as in the engine) run back to back at one row, then `torch.sum` over the
same repacked bytes in the same order: the rate a plain read of those bytes reaches on this machine. The
ratio says how far the GEMVs are from streaming their weights.

Run by hand from the repository root (not a test):
    .venv/bin/python -m bench.bench_gemv_stream [--formats Q4_0 Q4_K_M Q6_K Q8_0 bf16] [--threads 1 2]
        [--rounds 9] [--base-lib PATH]
Q4_K_M: Q4_K weights, with down in Q6_K (as a Q4_K_M file's ffn_down often is); bf16: dense bf16 weights
(the bf16 GEMM on its packed copy; 1.9 GB per library). --base-lib adds another
build of the kernels (another tree's `python -c "from deterministic_inference.ops.native_build import
build; print(build())"`). Rounds alternate the columns; the table gives medians, and each column's ratio to
ours as the median of the per-round ratios (the machine's speed moves within minutes).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from deterministic_inference.ops.linear import Linear
from deterministic_inference.ops.native import NativeKernels, load, native_kernels
from deterministic_inference.ops.quant_probe import random_weight

LAYERS = 16
SHAPES = ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192))  # (N, K) of one layer's GEMVs


def layer_format(formats: str, k: int) -> str:
    """The block format of a layer's GEMV with k inputs in a file of `formats`."""
    if formats == "Q4_K_M":
        return "Q6_K" if k == 8192 else "Q4_K"
    return formats


def layer_linear(kernels: NativeKernels, formats: str, n: int, k: int, generator: torch.Generator) -> Linear:
    """One GEMV's linear as the engine builds it: a quantized weight repacked, or a bf16 one packed."""
    if formats == "bf16":
        weight = (torch.randn(n, k, generator=generator) * 0.02).bfloat16()
        return Linear(weight, None, batch_invariant=True, kernels=kernels)
    quantized = random_weight(layer_format(formats, k), n, k, generator)
    return Linear(quantized, None, batch_invariant=True, kernels=kernels, dtype=torch.bfloat16)


def weight_copies(linear: Linear) -> list[torch.Tensor]:
    """The bytes a linear's GEMM reads: its repacked quantized parts, or its packed bf16 weight."""
    if linear._quant is not None:
        return list(linear._quant._repacked)
    return [linear._native[1]] if linear._native is not None else []


def gemvs(kernels: NativeKernels, formats: str) -> tuple[Callable[[], None], list[torch.Tensor]]:
    """One decode step's GEMVs (a call running them all at one row) and the weight bytes they read."""
    generator = torch.Generator().manual_seed(0)
    linears = [layer_linear(kernels, formats, n, k, generator) for _ in range(LAYERS) for n, k in SHAPES]
    rows = {k: torch.randn(1, k, generator=generator).bfloat16() for _, k in SHAPES}
    calls = [(linear, rows[linear.in_features]) for linear in linears]

    def step() -> None:
        for linear, x in calls:
            linear(x)

    return step, [copy for linear in linears for copy in weight_copies(linear)]


def stream(copies: list[torch.Tensor]) -> Callable[[], None]:
    """A plain read of the same bytes: torch.sum over each copy viewed as fp32 (its values do not matter)."""
    raw = [copy.view(-1).view(torch.uint8) for copy in copies]
    views = [b[: b.numel() // 4 * 4].view(torch.float32) for b in raw]

    def read() -> None:
        for view in views:
            view.sum()

    return read


def measure(columns: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """ms per step of each column, `rounds` rounds with the columns alternated."""
    times: dict[str, list[float]] = {name: [] for name in columns}
    for fn in columns.values():
        fn()  # warm-up
    for _ in range(rounds):
        for name, fn in columns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--formats", nargs="+", default=["Q4_0", "Q4_K_M", "Q6_K", "Q8_0", "bf16"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--base-lib", type=Path, help="another build of the kernels to compare against")
    args = parser.parse_args()
    libraries = {"ours": native_kernels()}
    if args.base_lib:
        libraries["base"] = load(args.base_lib)
    print("| threads | formats | MB | column | ms per step (median) | GB/s | / ours (median of rounds) |")
    print("|---|---|---|---|---|---|---|")
    for formats in args.formats:
        columns: dict[str, Callable[[], None]] = {}
        megabytes = 0.0
        for name, kernels in libraries.items():
            step, copies = gemvs(kernels, formats)
            columns[name] = step
            if name == "ours":
                columns["torch.sum, same bytes"] = stream(copies)
                megabytes = sum(copy.numel() * copy.element_size() for copy in copies) / 1e6
        for threads in args.threads:
            torch.set_num_threads(threads)
            times = measure(columns, args.rounds)
            for name, values in times.items():
                ratio = statistics.median(a / b for a, b in zip(values, times["ours"], strict=True))
                median = statistics.median(values)
                print(
                    f"| {threads} | {formats} | {megabytes:.0f} | {name} | {median:.2f} | "
                    f"{megabytes / median:.1f} | {ratio:.3f} |"
                )


if __name__ == "__main__":
    main()
