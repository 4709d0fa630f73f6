"""Portable numerics kernels (ops/portable.py; csrc/portable_math.h, sampling.c, rotary_tables.c,
gemm_f32.c): accurate against float64 references, the same bits for -march=native / x86-64-v3 / x86-64
builds, each row independent of the others and of the thread count, bad inputs refused.

Every build goes to a pytest temporary directory, never to the user's cache."""

from __future__ import annotations

import math
import platform
from collections.abc import Callable

import pytest
import torch

from deterministic_inference.ops import native_build, portable
from deterministic_inference.ops.backend import NativeBackend, Numerics
from deterministic_inference.ops.native import NativeKernels
from deterministic_inference.ops.native_build import NativeBuildError
from deterministic_inference.ops.rope import INITIAL_POSITIONS, RotaryTable
from deterministic_inference.ops.selfcheck import torch_threads
from tests.ops.helpers import bits

X86 = platform.machine().lower() in ("x86_64", "amd64")
INF = float("inf")


def logits_rows(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """[rows, vocab] fp32 from flat to peaked rows, some with -inf columns (masked tokens)."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.tensor([0.3, 4.0, 40.0])[torch.arange(rows) % 3]
    logits = torch.randn(rows, vocab, generator=gen) * scales[:, None]
    masked = (torch.rand(rows, vocab, generator=gen) < 0.2) & (torch.arange(rows)[:, None] % 2 == 1)
    masked[:, 0] = False
    return logits.masked_fill(masked, -INF)


def all_outputs(kernels: NativeKernels) -> list[torch.Tensor]:
    """Every portable op on fixed inputs (vocab sizes around the 16-lane tails)."""
    out: list[torch.Tensor] = []
    for vocab in (1, 15, 17, 1000, 49152):
        rows = logits_rows(5, vocab, vocab)
        out.append(portable.log_softmax_rows(rows, kernels))
        out.append(portable._rows(rows, 1, kernels))  # softmax
        out.append(portable._rows(rows.abs().clamp(max=1e30), 2, kernels))  # cumsum
    inv = portable.inverse_frequencies(kernels, 10000.0, 64)
    out.append(inv)
    out.extend(portable.rotary_tables(kernels, inv, 4096))
    gen = torch.Generator().manual_seed(1)
    for m, n, k in ((1, 33, 70), (6, 64, 64), (13, 200, 129)):
        x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
        bias = torch.randn(n, generator=gen)
        out.append(portable.gemm_f32(kernels, x, portable.pack_f32(kernels, w), n, bias))
    gate_up = 4 * torch.randn(9, 2 * 77, generator=gen)  # Gemma's GeGLU and soft-capping (csrc/rowwise.c)
    out.extend(kernels.gelu_tanh_mul(gate_up.to(dtype)).float() for dtype in (torch.float32, torch.bfloat16))
    out.append(kernels.softcap(60 * torch.randn(5, 1000, generator=gen), 30.0))
    return out


@pytest.mark.skipif(not X86, reason="the alternative builds use x86-64 -march levels")
def test_march_does_not_change_bits(
    kernels: NativeKernels, march_builds: dict[str, NativeKernels]
) -> None:
    expected = [bits(t) for t in all_outputs(kernels)]
    for name, other in march_builds.items():
        got = [bits(t) for t in all_outputs(other)]
        differing = [i for i, (a, b) in enumerate(zip(expected, got, strict=True)) if not torch.equal(a, b)]
        assert not differing, f"{name} vs native: outputs {differing} differ"


@pytest.mark.skipif(not X86, reason="the alternative builds use x86-64 -march levels")
def test_elementary_functions_same_bits_across_builds(
    kernels: NativeKernels, march_builds: dict[str, NativeKernels]
) -> None:
    grid = [x / 7.0 for x in range(-6000, 6000, 7)]

    def values(k: NativeKernels) -> list[float]:
        lib = k.library
        return (
            [f(x) for x in grid for f in (lib.detinf_test_expf, lib.detinf_test_exp)]
            + [lib.detinf_test_log(abs(x) + 1e-300) for x in grid]
            + [lib.detinf_test_sincos(x * 100.0, c) for x in grid for c in (0, 1)]
        )

    expected = values(kernels)
    for name, other in march_builds.items():
        assert values(other) == expected, name


def test_elementary_functions_are_accurate(kernels: NativeKernels) -> None:
    lib = kernels.library
    for x in torch.tensor([i / 97.0 for i in range(-8400, 8500)]).tolist():  # fp32 inputs, as it takes
        assert abs(lib.detinf_test_expf(x) - math.exp(x)) <= 3e-7 * math.exp(x) + 1e-38, x
    for x in [i / 3.0 for i in range(-2000, 2000)]:
        assert abs(lib.detinf_test_exp(x) - math.exp(x)) <= 4e-16 * math.exp(x), x
    for x in [1e-310, 1e-300, 0.5, 0.7071, 1.0, 1.0 + 1e-12, 1.4142, 2.0, 10000.0, 500000.0, 1e300]:
        assert abs(lib.detinf_test_log(x) - math.log(x)) <= 4e-16 * max(1.0, abs(math.log(x))), x
    for x in [i * 0.731 for i in range(-3000, 3000)] + [131071.0 * 0.9, 1e5 + 0.25]:
        assert abs(lib.detinf_test_sincos(x, 0) - math.sin(x)) < 2e-15 * max(1.0, abs(x) * 1e-3), x
        assert abs(lib.detinf_test_sincos(x, 1) - math.cos(x)) < 2e-15 * max(1.0, abs(x) * 1e-3), x
    assert lib.detinf_test_expf(0.0) == 1.0 and lib.detinf_test_expf(-100.0) == 0.0
    assert lib.detinf_test_expf(-INF) == 0.0 and math.isnan(lib.detinf_test_expf(math.nan))
    assert lib.detinf_test_log(1.0) == 0.0 and lib.detinf_test_log(0.0) == -INF


def test_row_ops_match_float64_references(kernels: NativeKernels) -> None:
    rows = logits_rows(6, 3000, 7)
    ref = torch.log_softmax(rows.double(), dim=1)
    got = portable.log_softmax_rows(rows, kernels)
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), finite)
    error = (got.double() - ref)[finite].abs() / (ref[finite].abs() * 2.0**-23 + 1e-6)
    assert float(error.max()) <= 1.0  # within an fp32 ulp of the value (plus 1e-6 absolute)
    probs = portable.softmax_rows(rows)
    assert float((probs.double() - torch.softmax(rows.double(), dim=1)).abs().max()) < 1e-6
    assert float(probs[rows == -INF].abs().max()) == 0.0  # masked tokens: exactly zero probability
    sums = portable.cumsum_rows(probs)
    assert float((sums.double() - torch.cumsum(probs.double(), dim=1)).abs().max()) < 1e-6


@pytest.mark.parametrize("threads", [1, 2])
def test_each_row_alone_equals_the_batch(kernels: NativeKernels, threads: int) -> None:
    rows = logits_rows(40, 5000, 3)  # above the kernels' threading threshold
    with torch_threads(threads):
        batch = [bits(portable.log_softmax_rows(rows, kernels)), bits(portable.softmax_rows(rows))]
    for r in (0, 17, 39):
        assert torch.equal(bits(portable.log_softmax_rows(rows[r], kernels)), batch[0][r])
        assert torch.equal(bits(portable.softmax_rows(rows[r : r + 1]))[0], batch[1][r])


def test_nan_and_infinite_rows() -> None:
    rows = torch.tensor([[0.0, math.nan, 1.0], [-INF, -INF, -INF], [INF, 0.0, 1.0], [-INF, 2.0, 2.0]])
    out = portable.log_softmax_rows(rows)
    assert bool(out[:3].isnan().all())
    log_half = float(torch.tensor(-math.log(2.0), dtype=torch.float32))
    assert out[3, 0] == -INF and float(out[3, 1]) == float(out[3, 2]) == log_half


def test_gemm_f32_rows_do_not_depend_on_the_batch(kernels: NativeKernels) -> None:
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(130, 96, generator=gen), torch.randn(11, 96, generator=gen)
    packed = portable.pack_f32(kernels, w)
    whole = bits(portable.gemm_f32(kernels, x, packed, 130, None))
    for r in range(11):
        assert torch.equal(bits(portable.gemm_f32(kernels, x[r : r + 1], packed, 130, None))[0], whole[r])
    reference = x.double() @ w.double().T
    assert float((portable.gemm_f32(kernels, x, packed, 130, None).double() - reference).abs().max()) < 1e-4


def test_bad_inputs_are_refused(kernels: NativeKernels) -> None:
    with pytest.raises(ValueError, match="packed"):
        portable.gemm_f32(kernels, torch.zeros(2, 5), torch.zeros(16 * 4), 3, None)
    with pytest.raises(ValueError, match="fp32"):
        portable.pack_f32(kernels, torch.zeros(3, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2\\^20"):
        portable.rotary_tables(kernels, torch.tensor([1.0, 0.5]), 2_000_000)


def test_kernel_march_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native_build.MARCH_ENV, "x86-64-v3")
    assert native_build.isa_flags() == ("-march=x86-64-v3",)
    monkeypatch.delenv(native_build.MARCH_ENV)
    assert native_build.isa_flags() == ("-march=native",)
    monkeypatch.setenv(native_build.MARCH_ENV, "pentium4")
    with pytest.raises(NativeBuildError, match="DETINF_KERNEL_MARCH: 'pentium4' is not one of native"):
        native_build.isa_flags()


def test_torch_log_softmax_switch_puts_torch_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative controls' switch really replaces the kernel by torch's (ISA-dispatched) function."""
    rows = logits_rows(4, 1000, 11)
    monkeypatch.setenv(portable.TORCH_LOG_SOFTMAX_ENV, "1")
    assert torch.equal(bits(portable.log_softmax_rows(rows)), bits(torch.log_softmax(rows, dim=-1)))


def test_rotary_tables_are_accurate_and_used_by_the_native_backend(kernels: NativeKernels) -> None:
    """Inverse frequencies within 2 fp32 ulps of float64; cos / sin of each fp32 angle within one
    rounding of float64; the native backend's tables are these."""
    numerics = Numerics(dtype=torch.bfloat16, batch_invariant=True, tile_rows=4)
    table = NativeBackend(numerics, kernels).rotary_table(64, 500000.0, 8192, None)
    table.cover(torch.tensor([8191]))  # grown to the whole range (test_rotary_table_grows_...)
    inv = portable.inverse_frequencies(kernels, 500000.0, 64)  # [32]
    exact = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    assert float(((inv.double() - exact) / exact).abs().max()) < 2.0**-22
    angles = (torch.arange(8192).float()[:, None] * inv[None, :]).double()  # the fp32 angles
    assert float((table.cos[:, :32].double() - angles.cos()).abs().max()) < 6e-8
    assert float((table.sin[:, 32:].double() - angles.sin()).abs().max()) < 6e-8
    assert torch.equal(bits(table.cos[:, :32]), bits(table.cos[:, 32:]))
    assert torch.equal(bits(table.sin), bits(portable.rotary_tables(kernels, inv, 8192)[1]))


def test_rotary_table_grows_on_demand_with_the_whole_tables_rows(kernels: NativeKernels) -> None:
    """A portable table starts at INITIAL_POSITIONS rows and `cover` grows it (doubling, capped at
    max_positions) to rows bit for bit those of the table computed whole; a range the reduction cannot
    take is refused when the table is made, not when a request reaches it. Negative control: the same
    comparison one position off detects a difference."""
    table = RotaryTable(64, 10000.0, 10_000, None, kernels=kernels)
    assert table.cos.shape == (INITIAL_POSITIONS, 64)
    table.cover(torch.tensor([3, INITIAL_POSITIONS - 1]))  # already covered: unchanged
    assert table.cos.shape[0] == INITIAL_POSITIONS
    table.cover(torch.tensor([7, INITIAL_POSITIONS + 5]))
    assert table.cos.shape[0] == 2 * INITIAL_POSITIONS
    table.cover(torch.tensor([9_999]))
    assert table.cos.shape[0] == 10_000
    whole_cos, whole_sin = portable.rotary_tables(
        kernels, portable.inverse_frequencies(kernels, 10000.0, 64), 10_000
    )
    assert torch.equal(bits(table.cos), bits(whole_cos)) and torch.equal(bits(table.sin), bits(whole_sin))
    assert not torch.equal(bits(table.cos[1:]), bits(whole_cos[:-1]))  # negative control
    table.cover(torch.tensor([20_000]))  # beyond max_positions: left for the kernels' range check
    assert table.cos.shape[0] == 10_000
    with pytest.raises(ValueError, match="2\\^20"):
        RotaryTable(64, 10000.0, 2_000_000, None, kernels=kernels)


def test_backend_logprobs_are_the_samplers(kernels: NativeKernels) -> None:
    """A trainer's logprobs (the backend's log_softmax_rows) equal the sampler's prompt logprobs bits."""
    from deterministic_inference.engine import sampler

    logits = logits_rows(6, 777, 21)
    numerics = Numerics(dtype=torch.float32, batch_invariant=True, tile_rows=4)
    trainer = NativeBackend(numerics, kernels).log_softmax_rows(logits)  # [6, 777]
    targets = [3, 700, 5, 0, 10, 776]
    values, _ = sampler.prompt_logprobs(logits, targets, 0)
    assert bits(torch.tensor(values)).tolist() == bits(trainer[range(6), targets]).tolist()


def test_greedy_rows_give_log_softmax_rows_bits_at_the_first_argmax() -> None:
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(6, 49152, generator=gen) * torch.tensor([[0.1], [1.0], [4.0], [30.0], [1.0], [1.0]])
    rows[4, [100, 7, 40000]] = 50.0  # ties: the first index wins
    rows[5] = float("-inf")  # nothing finite: token 0, a NaN logprob, as log_softmax_rows gives
    nan_row = torch.randn(1, 49152, generator=gen)
    nan_row[0, 123] = float("nan")
    found = portable.greedy_rows(torch.cat((rows, nan_row)))
    assert found is not None
    tokens, values, usable = found
    assert usable == [True] * 6 + [False]
    assert tokens[:6] == [int(torch.argmax(row)) for row in rows] and tokens[4] == 7
    reference = portable.log_softmax_rows(rows)
    for r in range(6):
        expected = reference[r, tokens[r]].reshape(1).view(torch.int32)
        assert torch.tensor([values[r]], dtype=torch.float32).view(torch.int32).equal(expected)


def test_greedy_rows_defer_to_torch_under_the_test_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(portable.TORCH_LOG_SOFTMAX_ENV, "1")
    assert portable.greedy_rows(torch.zeros(2, 10)) is None


def greedy_bits(kernels: NativeKernels, rows: torch.Tensor) -> list[tuple[int, int, int]]:
    """detinf_greedy_rows of one build on fp32 rows [R, V]: per row (token, logprob bits, NaN-free flag);
    a row holding a NaN reports (-1, 0, 0), as nothing is written for it."""
    count, vocab = rows.shape
    tokens = torch.full((count,), -1, dtype=torch.int64)
    values = torch.zeros(count, dtype=torch.float32)
    usable = torch.zeros(count, dtype=torch.uint8)
    kernels.library.detinf_greedy_rows(
        rows.data_ptr(), count, vocab, tokens.data_ptr(), values.data_ptr(), usable.data_ptr()
    )
    return list(zip(tokens.tolist(), bits(values).tolist(), usable.tolist(), strict=True))


def greedy_cases() -> list[torch.Tensor]:
    """Rows around the 16-lane tails (vocab 1 to 49152), with ties, -0.0 beside +0.0 as the maximum,
    masked (-inf) tokens, an all -inf row, a NaN row and a maximum in the last column."""
    cases = []
    for vocab in (1, 2, 15, 16, 17, 33, 1000, 49152):
        rows = logits_rows(9, vocab, vocab)
        if vocab >= 2:
            rows[3, vocab // 2 :] = rows[3].max() + 1.0  # tie from the middle to the end: first wins
            rows[4] = -INF
            rows[5, -1] = 1e4  # the maximum in the last column
            rows[6] = -1.0
            rows[6, vocab - 1], rows[6, max(vocab - 2, 0)] = 0.0, -0.0
        rows[7, vocab // 3] = math.nan
        cases.append(rows)
    return cases


@pytest.mark.skipif(not X86, reason="the alternative builds use x86-64 -march levels")
@pytest.mark.parametrize("threads", [1, 2])
def test_greedy_rows_same_bits_across_builds_rows_and_threads(
    kernels: NativeKernels, march_builds: dict[str, NativeKernels], threads: int
) -> None:
    """The greedy kernel's AVX-512 path (16 lanes in one register) gives the scalar loops' bits: the
    native build equals the x86-64-v3 (AVX2) and x86-64 (SSE2) ones, and each row alone equals the row at
    the first, a middle and the last position of the batch, at 1 and 2 threads."""
    for rows in greedy_cases():
        with torch_threads(threads):
            expected = greedy_bits(kernels, rows)
        for name, other in march_builds.items():
            assert greedy_bits(other, rows) == expected, f"{name}, vocab {rows.shape[1]}"
        for r in (0, rows.shape[0] // 2, rows.shape[0] - 1):
            assert greedy_bits(kernels, rows[r : r + 1].contiguous()) == [expected[r]]
        big = torch.cat([rows] * 5)  # 45 rows: above the kernel's threading threshold at vocab >= 1457
        with torch_threads(threads):
            assert greedy_bits(kernels, big) == expected * 5


@pytest.mark.skipif(not X86, reason="the alternative builds use x86-64 -march levels")
def test_negative_control_greedy_rows_see_another_exp(
    kernels: NativeKernels, flagged_build: Callable[[str], NativeKernels]
) -> None:
    """The comparisons above can fail: a build whose exp rounds each product and sum apart gives other
    logprob bits (the same tokens) on some rows. Two-token rows [0, d]: the logprob is -log(1 + exp(d)),
    where an ulp of exp(d) shows (over a whole vocabulary the sum hides it)."""
    other = flagged_build("-DDETINF_TEST_SEPARATE_STEPS")
    gaps = torch.linspace(-3.0, 0.0, 4096)
    rows = torch.stack([torch.zeros_like(gaps), gaps], dim=1).contiguous()  # [4096, 2]
    ours, theirs = greedy_bits(kernels, rows), greedy_bits(other, rows)
    assert [row[0] for row in ours] == [row[0] for row in theirs]
    assert any(a[1] != b[1] for a, b in zip(ours, theirs, strict=True))
