"""The bf16 GEMM's paths side by side at the 1B Llama shapes: fp32 FMAs (gemm_fma.h) vs VDPBF16PS (and the
portable loop with --portable), each a build of the same kernels (bits equal: tests/ops/test_gemm_fma.py),
and, where the CPU has AMX-BF16, the tiles of `--numerics native` (gemm_amx.h: other bits, fixed per CPU
class; tests/ops/test_gemm_amx_bf16.py).

Run by hand from the repository root (not a test):
    .venv/bin/python -m bench.bench_gemm_bf16 [--rows 1 8 32 128 512] [--threads 1 2] [--rounds 7]
        [--base-lib PATH]
With --base-lib (another build of the kernels, e.g. the library another tree's `python -c "from
deterministic_inference.ops.native_build import build; print(build())"` prints) its AMX path is timed too,
beside this tree's, and the table gives base / amx. Rounds are interleaved and the best round of each path
is kept, so read the ratios: absolute times move with the machine's load. Weights are random, packed once as
the engine packs them.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch

from bench.bench_ops import best_times
from deterministic_inference.ops.native import NativeKernels, load
from deterministic_inference.ops.native_build import build

SHAPES = {  # (N, K) of Llama-3.2-1B, and of SmolLM2-135M (the default model under --numerics native)
    "qkv": (3072, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
    "135M qkv": (960, 576), "135M o": (576, 576), "135M gate_up": (3072, 576), "135M down": (576, 1536),
    "135M head": (49152, 576),
}  # fmt: skip
BUILDS = {
    "fma": ("-march=native", "-DDETINF_TEST_FORCE_FMA_GEMM"),
    "vdpbf16ps": ("-march=native", "-DDETINF_TEST_NO_FMA_GEMM"),
    "portable": ("-march=x86-64-v3",),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--portable", action="store_true", help="also the portable fmaf loop (slow)")
    parser.add_argument("--base-lib", type=Path, help="another build: its AMX path beside this tree's")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), help="names of SHAPES (default: all)")
    args = parser.parse_args()
    names = [name for name in BUILDS if args.portable or name != "portable"]
    libs: dict[str, NativeKernels] = {name: load(build(BUILDS[name])) for name in names}
    paths = {name: lib.gemm_bf16_path() for name, lib in libs.items()}
    amx_missing = libs["fma"].native_gemm_missing()
    if amx_missing is None:
        names.append("amx")
    base = load(args.base_lib) if args.base_lib and amx_missing is None else None
    if base is not None:
        names.append("amx base")
    print(f"paths: {paths}; amx: {amx_missing or 'yes'}")
    generator = torch.Generator().manual_seed(0)
    amx_column = (" | fma / amx" if "amx" in names else "") + (" | base / amx" if base else "") + " |"
    columns = " | ".join(f"{n} ms" for n in names)
    print(f"| threads | weight | M | {columns} | vdpbf16ps / fma{amx_column}")
    print("|---|---|---|" + "---|" * (len(names) + 1 + ("amx" in names) + (base is not None)))
    for threads in args.threads:
        torch.set_num_threads(threads)
        for shape_name, (n, k) in SHAPES.items():
            if args.shapes and shape_name not in args.shapes:
                continue
            w = (torch.randn(n, k, generator=generator) / k**0.5).bfloat16()
            packed = {name: lib.pack_bf16(w) for name, lib in libs.items()}
            for m in args.rows:
                x = torch.randn(m, k, generator=generator).bfloat16()
                fns = {
                    name: functools.partial(lib.gemm_bf16, x, packed[name], n, None, torch.bfloat16)
                    for name, lib in libs.items()
                }
                if "amx" in names:  # the native build's AMX-BF16 tiles on the FMA build's packed weight
                    fns["amx"] = functools.partial(
                        libs["fma"].gemm_bf16, x, packed["fma"], n, None, torch.bfloat16, native=True
                    )
                if base is not None:  # the same packed weight: the layout is the portable GEMM's
                    fns["amx base"] = functools.partial(
                        base.gemm_bf16, x, packed["fma"], n, None, torch.bfloat16, native=True
                    )
                times = best_times(fns, args.rounds)  # ms
                cells = " | ".join(f"{times[name]:.2f}" for name in names)
                ratio = times["vdpbf16ps"] / times["fma"]
                amx_ratio = f" {times['fma'] / times['amx']:.2f}x |" if "amx" in names else ""
                amx_ratio += f" {times['amx base'] / times['amx']:.2f}x |" if base else ""
                row = f"| {threads} | {shape_name} {n}x{k} | {m} | {cells} | {ratio:.2f}x |{amx_ratio}"
                print(row, flush=True)


if __name__ == "__main__":
    main()
