"""RMSNorm's bf16 rows on AVX-512 registers (csrc/rowwise.c, add_rms_norm_row_bf16) give the scalar
loops' bits: every element against a torch replay of the documented order (16 lane sums in ascending
order, the fixed lane tree, one rounding per operation), the native build against the x86-64 (SSE2) and
x86-64-v3 (AVX2) builds, which run the scalar loops, at several widths (the masked tails), row counts,
row positions and 1 and 2 threads. Negative control: the same replay with one sequential sum instead of
16 lanes differs from the kernel on some rows, so the order is observable and the comparisons can fail.

Builds go to a pytest temporary directory (tests/ops/conftest.py)."""

from __future__ import annotations

import platform

import pytest
import torch

from deterministic_inference.ops.native import NativeKernels
from deterministic_inference.ops.selfcheck import torch_threads
from tests.ops.helpers import bits
from tests.ops.test_native_rowwise import EPS, norm_inputs, run_norm

X86 = platform.machine().lower() in ("x86_64", "amd64")
WIDTHS = (1, 15, 16, 17, 77, 576, 2048)


def replay_row(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, lanes: int) -> torch.Tensor:
    """One bf16 row by the documented sequence in fp32 torch ops (each rounds once): the residual add
    rounded to bf16, x * x summed into `lanes` lane sums (element i into lane i % lanes, ascending), the
    lane tree, 1 / sqrt(mean + eps), then round(x * inv) and weight * that, rounded to bf16."""
    row = x.float()
    if delta is not None:
        row = (row + delta.float()).to(torch.bfloat16).float()
    sums = torch.zeros(lanes, dtype=torch.float32)
    for base in range(0, row.numel(), lanes):
        chunk = row[base : base + lanes]
        sums[: chunk.numel()] = sums[: chunk.numel()] + chunk * chunk
    width = lanes // 2
    while width >= 1:
        sums[:width] = sums[:width] + sums[width : 2 * width]
        width //= 2
    mean = sums[:1] / torch.tensor([float(row.numel())])
    inv = torch.tensor([1.0]) / torch.sqrt(mean + torch.tensor([EPS], dtype=torch.float32))
    normed = (row * inv).to(torch.bfloat16).float()
    return (weight.float() * normed).to(torch.bfloat16)


def replay(hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, lanes: int = 16) -> torch.Tensor:
    return torch.stack([replay_row(hidden[r], delta[r], weight, lanes) for r in range(hidden.shape[0])])


def finite_rows(hidden: torch.Tensor, delta: torch.Tensor) -> list[int]:
    """Rows whose sum of squares stays finite in fp32 (the replay's torch.sqrt and the kernel agree there;
    the other rows are compared across builds only)."""
    total = (hidden.float() + delta.float()).double().pow(2).sum(1)
    return [r for r in range(hidden.shape[0]) if float(total[r]) < 1e37]


@pytest.mark.parametrize("width", WIDTHS)
def test_bf16_norm_equals_the_replay_of_its_order(kernels: NativeKernels, width: int) -> None:
    hidden, delta, weight = norm_inputs(width, torch.bfloat16, seed=width)
    normed, _ = run_norm(kernels, hidden, delta, weight)
    rows = finite_rows(hidden, delta)
    expected = replay(hidden, delta, weight)
    assert torch.equal(bits(normed[rows]), bits(expected[rows]))


@pytest.mark.skipif(not X86, reason="the alternative builds use x86-64 -march levels")
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_norm_same_bits_across_builds_rows_and_threads(
    kernels: NativeKernels, march_builds: dict[str, NativeKernels], threads: int
) -> None:
    for width in WIDTHS:
        hidden, delta, weight = norm_inputs(width, torch.bfloat16, seed=width)
        batch = torch.cat([hidden] * 5), torch.cat([delta] * 5)  # 45 rows: above the threading threshold
        with torch_threads(threads):
            expected = [bits(t) for t in run_norm(kernels, batch[0], batch[1], weight)]
            for name, other in march_builds.items():
                got = [bits(t) for t in run_norm(other, batch[0], batch[1], weight)]
                assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), (name, width)
        for r in (0, 22, 44):  # a row alone equals it at the first, a middle and the last position
            alone = run_norm(kernels, batch[0][r : r + 1], batch[1][r : r + 1], weight)
            assert torch.equal(bits(alone[0])[0], expected[0][r])
            assert torch.equal(bits(alone[1])[0], expected[1][r])
        no_delta = run_norm(kernels, hidden, None, weight)[0]
        assert torch.equal(bits(no_delta), bits(run_norm(march_builds["x86-64"], hidden, None, weight)[0]))


def test_negative_control_a_sequential_sum_is_seen(kernels: NativeKernels) -> None:
    """200 random rows of 2048: the one-lane sum's last-bit changes reach the bf16 outputs of some rows
    (10 here; 1 at width 576), the 16-lane replay of none."""
    generator = torch.Generator().manual_seed(0)
    hidden = (3.0 * torch.randn(200, 2048, generator=generator)).to(torch.bfloat16)
    delta = torch.randn(200, 2048, generator=generator).to(torch.bfloat16)
    weight = (1.0 + 0.1 * torch.randn(2048, generator=generator)).to(torch.bfloat16)
    normed, _ = run_norm(kernels, hidden, delta, weight)
    assert torch.equal(bits(normed), bits(replay(hidden, delta, weight)))
    assert not torch.equal(bits(normed), bits(replay(hidden, delta, weight, lanes=1)))
