"""Random quantized weights and the start-up probe of the quantized GEMM (next to ops/quant.py).

`random_weight` builds blocks directly from random bytes with chosen fp16 scales (the `gguf` package
cannot quantize to the K formats, so tests and the self-check make every format this way).
`probe_quant_linear` is what the start-up self-check runs for each format a model uses: random rows
computed alone with one thread vs inside batches of several sizes, at the first, a middle and the last
position, with the configured thread count; it returns a ProbeResult naming the op, format and shape.
"""

from __future__ import annotations

import torch

from deterministic_inference.ops.native import NativeKernels
from deterministic_inference.ops.quant import BlockFormat, QuantizedWeight, QuantLinear, block_format
from deterministic_inference.ops.selfcheck import ProbeResult, torch_threads

# byte offsets of each format's fp16 scale fields within a block: d (and the min / dmin after it)
SCALE_FIELDS = {"Q4_0": (0,), "Q5_0": (0,), "Q8_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2),
                "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # fmt: skip
PROBE_SIZES = (1, 3, 8, 33, 64)  # batch sizes each probe row is placed in


def random_fp16_bytes(count: int, generator: torch.Generator, wide: bool) -> torch.Tensor:
    """[count, 2] uint8: fp16 numbers of random sign, magnitudes 2^-14..2^-4 (weights' scales) or, when
    `wide`, any finite fp16 (subnormals and zeros included)."""
    if wide:
        bits = torch.randint(0, 1 << 16, (count,), generator=generator, dtype=torch.int32)
        exponent = (bits >> 10) & 0x1F
        bits = torch.where(exponent == 0x1F, bits & ~(0x10 << 10), bits)  # no inf / NaN: exponent 15
        bits[torch.rand(count, generator=generator) < 0.02] = 0
        return bits.to(torch.int16).view(torch.uint8).view(count, 2)
    magnitude = torch.exp2(torch.empty(count).uniform_(-14.0, -4.0, generator=generator))
    sign = torch.where(torch.rand(count, generator=generator) < 0.5, -1.0, 1.0)
    return (magnitude * sign).half().view(torch.uint8).view(count, 2)


def random_weight(
    fmt: BlockFormat | str, rows: int, in_features: int, generator: torch.Generator, wide: bool = False
) -> QuantizedWeight:
    """A [rows, in_features] weight of random blocks: random integer bytes, random fp16 scales."""
    fmt = fmt if isinstance(fmt, BlockFormat) else block_format(fmt)
    blocks = in_features // fmt.block_values
    data = torch.randint(0, 256, (rows, blocks, fmt.block_bytes), generator=generator, dtype=torch.uint8)
    for offset in SCALE_FIELDS[fmt.name]:
        data[:, :, offset : offset + 2] = random_fp16_bytes(rows * blocks, generator, wide).view(
            rows, blocks, 2
        )
    return QuantizedWeight(data.view(rows, blocks * fmt.block_bytes), fmt, (rows, in_features))


def probe_quant_linear(
    kernels: NativeKernels,
    fmt: str,
    out_features: int,
    in_features: int,
    threads: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    probe_rows: int = 3,
    test_flags: int = 0,
) -> ProbeResult:
    """Rows alone (one thread) vs inside batches of PROBE_SIZES (`threads` threads), bitwise, for one
    format at one [out_features, in_features] shape; activations in `dtype`, output fp32 (every bit of
    the sums shows). `test_flags`: the kernel's test hooks (negative controls of the tests only)."""
    weight = random_weight(fmt, out_features, in_features, generator)
    linear = QuantLinear(kernels, [weight], bias=None, out_dtype=torch.float32)
    rows = torch.randn(probe_rows, in_features, generator=generator).to(dtype)

    def run(x: torch.Tensor) -> torch.Tensor:
        return _bits(linear.forward_with_flags(x, test_flags))

    with torch_threads(1):
        alone = [run(rows[i : i + 1])[0] for i in range(probe_rows)]
    mismatches: list[str] = []
    with torch_threads(threads):
        for size in PROBE_SIZES:
            batch = torch.randn(size, in_features, generator=generator).to(dtype)
            placed = {
                position: (size + i) % probe_rows for i, position in enumerate((0, size // 2, size - 1))
            }
            for position, row in placed.items():
                batch[position] = rows[row]
            out = run(batch)
            mismatches.extend(
                f"M={size} row {position}"
                for position, row in placed.items()
                if not torch.equal(out[position], alone[row])
            )
    shape = f"{fmt} [{out_features}, {in_features}]"
    detail = (
        "; ".join(mismatches[:3])
        if mismatches
        else f"rows alone == inside M in {PROBE_SIZES}, threads {threads}"
    )
    return ProbeResult(op="quant_linear", shape=shape, ok=not mismatches, detail=detail)


def _bits(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    return x.view(torch.int16) if x.element_size() == 2 else x.view(torch.int32)
