"""The compiled bf16 GEMM (ops/csrc/gemm.c): its bits are exactly the documented order of fp32 sums (a
float64 re-enactment checks every element), the VDPBF16PS and portable builds agree bit for bit, it is
accurate, and it refuses inputs it would misread. Row invariance through Linear is in test_linear.py."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from deterministic_inference.ops.native import NativeKernels, packed_numel
from tests.ops.helpers import HIDDEN, INTER, bits

X86 = platform.machine().lower() in ("x86_64", "amd64")
# (m, n, k): odd k, n not a multiple of 16 or 64, one row, more rows than a tile
SHAPES = ((1, 16, 2), (3, 37, 33), (5, 64, 7), (9, 130, 64), (2, 17, 1))
TINY = 1.1754943508222875e-38  # the smallest normal fp32
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def portable(march_builds: dict[str, NativeKernels]) -> NativeKernels:
    """A build without AVX512-BF16 (x86-64-v3 = AVX2): the portable fmaf path."""
    return march_builds["x86-64-v3"]


def _wide(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """bf16 values over ~60 binades, with zeros and denormals: every rounding branch gets exercised."""
    generator = torch.Generator().manual_seed(seed)
    binades = torch.randint(-30, 30, shape, generator=generator)
    values = torch.randn(shape, generator=generator) * torch.exp2(binades)
    values[torch.rand(shape, generator=generator) < 0.05] = 0.0
    values[torch.rand(shape, generator=generator) < 0.03] = 3e-39  # a bf16 denormal
    return values.bfloat16()


def _flush(x: torch.Tensor) -> torch.Tensor:
    """Denormals to signed zero (VDPBF16PS's DAZ/FTZ)."""
    return torch.where(x.abs() < TINY, torch.zeros_like(x).copysign(x), x)


def documented_order(x: torch.Tensor, w: torch.Tensor, odd_first: bool = True) -> torch.Tensor:
    """gemm.c's definition, replayed in float64: from +0, for each pair p add x[2p+1] w[2p+1] then
    x[2p] w[2p], each add rounded once to fp32 (the bf16 product is exact, and the float64 sum rounds to
    the same fp32 value as an exact sum would), inputs and results flushed. -> [m, n] fp32."""
    xs, ws = _flush(x.double()), _flush(w.double())  # [m, k], [n, k]
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32)
    for p in range(0, x.shape[1], 2):
        pair = [p + 1, p] if odd_first else [p, p + 1]
        for i in pair:
            if i < x.shape[1]:
                acc = _flush((acc.double() + xs[:, i : i + 1] * ws[:, i].unsqueeze(0)).float())
            else:  # the zero padding of an odd k: acc + 0 * 0
                acc = (acc.double() + 0.0).float()
    return acc


def test_packed_size() -> None:
    assert packed_numel(16, 2) == 32 and packed_numel(17, 3) == 32 * 4 and packed_numel(576, 576) == 576 * 576


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_element_is_the_documented_sum(
    kernels: NativeKernels, portable: NativeKernels, shape: tuple[int, int, int]
) -> None:
    m, n, k = shape
    x, w = _wide((m, k), 1), _wide((n, k), 2)
    expected = bits(documented_order(x, w))
    for name, lib in (("default", kernels), ("portable", portable)):
        out = lib.gemm_bf16(x, lib.pack_bf16(w), n, None, torch.float32)
        assert torch.equal(bits(out), expected), name


def test_negative_control_the_other_pair_order_is_caught(kernels: NativeKernels) -> None:
    """The element-wise comparison above can fail: adding the even element of each pair first (the
    other natural order) changes some sums."""
    x, w = _wide((9, 64), 3), _wide((130, 64), 4)
    out = bits(kernels.gemm_bf16(x, kernels.pack_bf16(w), 130, None, torch.float32))
    assert not torch.equal(out, bits(documented_order(x, w, odd_first=False)))
    assert torch.equal(out, bits(documented_order(x, w)))


@pytest.mark.skipif(not X86, reason="the portable build uses an x86-64 -march level")
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_portable_build_gives_the_same_bits_at_model_shapes(
    kernels: NativeKernels, portable: NativeKernels, out_dtype: torch.dtype, with_bias: bool
) -> None:
    generator = torch.Generator().manual_seed(5)
    for n, k in ((2 * INTER, HIDDEN), (HIDDEN, INTER)):
        w = (torch.randn(n, k, generator=generator) / k**0.5).bfloat16()
        x = torch.randn(33, k, generator=generator).bfloat16()
        bias = torch.randn(n, generator=generator) if with_bias else None
        outs = [lib.gemm_bf16(x, lib.pack_bf16(w), n, bias, out_dtype) for lib in (kernels, portable)]
        assert torch.equal(bits(outs[0]), bits(outs[1])), (n, k)


def test_default_build_picks_the_path_for_the_cpu(kernels: NativeKernels) -> None:
    """VDPBF16PS where it is fast (AVX512-BF16 without AMX: AMD), fp32 FMAs on Intel's AVX-512 CPUs
    (with AMX VDPBF16PS is slow; without AVX512-BF16 it is missing), else the portable loop."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    if "avx512f" in flags and ("amx_bf16" in flags or "avx512_bf16" not in flags):
        expected = "fma"
    else:
        expected = "vdpbf16ps" if "avx512_bf16" in flags else "portable"
    assert kernels.gemm_bf16_path() == expected


def test_accurate_against_float64_with_bias_and_bf16_rounding(kernels: NativeKernels) -> None:
    generator = torch.Generator().manual_seed(6)
    w = (torch.randn(300, 200, generator=generator) / 14).bfloat16()
    x = torch.randn(7, 200, generator=generator).bfloat16()
    bias = torch.randn(300, generator=generator)
    exact = x.double() @ w.double().T + bias.double()  # [7, 300]
    magnitude = x.double().abs() @ w.double().abs().T + bias.double().abs()
    packed = kernels.pack_bf16(w)
    fp32 = kernels.gemm_bf16(x, packed, 300, bias, torch.float32).double()
    assert ((fp32 - exact).abs() <= 200 * 2.0**-24 * magnitude).all()  # k rounding errors of 2^-24 at most
    bf16 = kernels.gemm_bf16(x, packed, 300, bias, torch.bfloat16)
    assert torch.equal(bits(bf16), bits(fp32.float().bfloat16()))  # one rounding of the fp32 result


def test_bf16_outputs_of_nans_and_denormals_round_as_torch(kernels: NativeKernels) -> None:
    """The bf16 store rounds 32 values at a time by VCVTNE2PS2BF16 where the build has it, which quiets a
    NaN its own way and reads a denormal as zero: runs holding one must still give f32_to_bf16's bits
    (torch's rounding, and the one quiet NaN 0x7FC0 for every NaN). A zero weight makes each output its
    bias: NaNs of both signs, fp32 denormals that round to bf16 denormals or up to the smallest normal,
    values that round up to infinity, in some runs of 32 only."""
    n, k = 160, 32
    bias = torch.randn(n, generator=torch.Generator().manual_seed(8))
    special = [float("nan"), -float("nan"), 3e-39, -1.17e-38, 1.1754942e-38, 3.4028235e38, -3.40282e38]
    bias[40 : 40 + len(special)] = torch.tensor(special)
    bias[100] = 2e-45  # the smallest fp32 denormal
    packed = kernels.pack_bf16(torch.zeros(n, k, dtype=BF16))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(9)).bfloat16()
    out = kernels.gemm_bf16(x, packed, n, bias, BF16)
    expected = bits(bias.bfloat16())
    expected[bias.isnan()] = 0x7FC0
    assert torch.equal(bits(out), expected.expand(3, n))
    if kernels.native_gemm_missing() is None:  # the AMX-BF16 path stores through the same code
        assert torch.equal(bits(kernels.gemm_bf16(x, packed, n, bias, BF16, native=True)), bits(out))


def test_no_rows_gives_an_empty_result(kernels: NativeKernels) -> None:
    packed = kernels.pack_bf16(torch.ones(20, 8, dtype=BF16))
    out = kernels.gemm_bf16(torch.empty(0, 8, dtype=BF16), packed, 20, None, torch.float32)
    assert out.shape == (0, 20)


BAD_GEMM_CALLS = {  # name: (x, N, bias, out dtype) against a packed [20, 8] weight
    "fp32 x": (torch.ones(3, 8), 20, None, torch.float32),
    "strided x": (torch.ones(3, 16, dtype=BF16)[:, ::2], 20, None, torch.float32),
    "wrong k": (torch.ones(3, 10, dtype=BF16), 20, None, torch.float32),
    "wrong n": (torch.ones(3, 8, dtype=BF16), 40, None, torch.float32),
    "1-d x": (torch.ones(8, dtype=BF16), 20, None, torch.float32),
    "bf16 bias": (torch.ones(3, 8, dtype=BF16), 20, torch.ones(20, dtype=BF16), torch.float32),
    "short bias": (torch.ones(3, 8, dtype=BF16), 20, torch.ones(19), torch.float32),
    "fp16 out": (torch.ones(3, 8, dtype=BF16), 20, None, torch.float16),
}


@pytest.mark.parametrize("case", list(BAD_GEMM_CALLS))
def test_gemm_refuses_inputs_it_would_misread(kernels: NativeKernels, case: str) -> None:
    x, n, bias, out_dtype = BAD_GEMM_CALLS[case]
    packed = kernels.pack_bf16(torch.ones(20, 8, dtype=BF16))
    with pytest.raises(ValueError):
        kernels.gemm_bf16(x, packed, n, bias, out_dtype)


@pytest.mark.parametrize(
    "weight", [torch.ones(20, 8), torch.ones(8, 20, dtype=BF16).T], ids=["fp32", "strided"]
)
def test_pack_refuses_weights_it_would_misread(kernels: NativeKernels, weight: torch.Tensor) -> None:
    with pytest.raises(ValueError):
        kernels.pack_bf16(weight)
