"""The compiled row-wise kernels (ops/csrc/rowwise.c via NativeKernels.add_rms_norm, .silu_mul and
.rotary_write_kv): a row's bits depend on neither the batch, the row's position nor the thread count; an
SSE2-only build gives the same bits as -march=native; rotary and the KV write equal the torch path bit for
bit, RMSNorm and silu_mul are within one bf16 ulp (fp32: ~1e-6 relative) of torch's formulas; clamped silu
stays finite with the right sign. Inputs the C code would misread: test_native_rowwise_inputs.py.

Shapes: SmolLM2-135M (hidden 576, intermediate 1536, heads 9/3 x 64) and the tiny test models (64, 128,
4/2 x 16), plus widths that are not a multiple of 16 (the scalar tails). Every build goes to a pytest
temporary directory, never to the user's cache."""

from __future__ import annotations

import platform
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deterministic_inference.model_spec import ModelSpec
from deterministic_inference.ops.attention import AttentionMetadata, new_kv_cache, write_kv
from deterministic_inference.ops.backend import NativeBackend, Numerics
from deterministic_inference.ops.native import NativeKernels
from deterministic_inference.ops.norm import rms_norm
from deterministic_inference.ops.probes import norm_fn, rotary_fn
from deterministic_inference.ops.rope import RotaryTable
from tests.ops.helpers import (
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTER,
    KV_HEADS,
    THREADS,
    TINY_HEAD_DIM,
    TINY_HEADS,
    TINY_HIDDEN,
    TINY_INTER,
    TINY_KV_HEADS,
    bits,
    row_mismatches,
)

X86 = platform.machine().lower() in ("x86_64", "amd64")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
EPS = 1e-5


def _spec(hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, theta: float) -> ModelSpec:
    return ModelSpec(
        architecture="llama", vocab_size=256, hidden_size=hidden, intermediate_size=inter, num_layers=1,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=EPS, rope_theta=theta,
        max_position_embeddings=8192, tie_word_embeddings=True,
    )  # fmt: skip


SPECS = {
    "smollm2": _spec(HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, 100000.0),
    "tiny": _spec(TINY_HIDDEN, TINY_INTER, TINY_HEADS, TINY_KV_HEADS, TINY_HEAD_DIM, 10000.0),
    "odd": _spec(40, 37, 2, 1, 24, 10000.0),  # widths that are not multiples of 16: the scalar tails
}
# Gate values at and around silu's clamps (exp's argument is clamped to [-87, 88]), signed zeros and
# fp32 denormals (2**-140 is below bf16's smallest denormal: it becomes 0 in bf16).
SPECIAL_GATES = (100.0, -100.0, 90.0, -90.0, 88.0, -88.0, 87.0, -87.0, 20.0, -20.0, 0.0, -0.0)
TINY_GATES = (2.0**-130, -(2.0**-130), 2.0**-140, -(2.0**-140))
# (start position, tokens, block table) of the rotary cases' sequences, blocks of 16: positions 0..20,
# 8180..8188 (the end of an 8192-position table) and 100..106; blocks 2 and 5 are never written.
BLOCK = 16
SEQUENCES = ((0, 21, [3, 0]), (8180, 9, [5] * 511 + [1]), (100, 7, [5] * 6 + [4]))
NUM_BLOCKS = 6
Outputs = tuple[torch.Tensor, ...]


# --- fixtures and inputs


@pytest.fixture(scope="module")
def baseline(march_builds: dict[str, NativeKernels]) -> NativeKernels:
    """The build for the x86-64 baseline (SSE2 only)."""
    return march_builds["x86-64"]


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _with_extreme_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows 0 and 1 of fp32 `x` rescaled to fp32 denormals and to ~1e19 (squares overflow fp32)."""
    x = x.clone()
    x[0] *= 2.0**-130
    x[1] *= 1e19
    return x


def norm_inputs(width: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(hidden, delta [9, width], weight [width]): random rows, a denormal row, a huge row, a zero row."""
    hidden = _with_extreme_rows(_randn(9, width, seed=seed, scale=3.0))
    delta = _with_extreme_rows(_randn(9, width, seed=seed + 1))
    hidden[2], delta[2] = 0.0, 0.0
    weight = 1.0 + 0.1 * _randn(width, seed=seed + 2)
    return hidden.to(dtype), delta.to(dtype), weight.to(dtype)


def silu_inputs(inter: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """gate_up [7, 2 * inter]: random rows (x4) and two rows whose gates cycle through the special values."""
    gate_up = _randn(7, 2 * inter, seed=seed, scale=4.0)
    special = torch.tensor(SPECIAL_GATES + TINY_GATES)
    gate_up[0, :inter] = special.repeat(-(-inter // special.numel()))[:inter]
    gate_up[1, :inter] = special.roll(5).repeat(-(-inter // special.numel()))[:inter]
    return gate_up.to(dtype)


@pytest.fixture(scope="module")
def rotary_tables() -> dict[str, RotaryTable]:
    """The 8192-position cos/sin table of each shape."""
    return {name: RotaryTable(s.head_dim, s.rope_theta, 8192, None) for name, s in SPECS.items()}


def rotary_inputs(
    spec: ModelSpec, dtype: torch.dtype, extreme: bool
) -> tuple[torch.Tensor, AttentionMetadata]:
    """qkv [T, (H + 2 KVH) * D] for the tokens of SEQUENCES (x3; with `extreme`, a denormal and a huge row)
    and their attention metadata."""
    meta = AttentionMetadata.build(SEQUENCES, BLOCK)
    width = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    qkv = _randn(meta.num_tokens, width, seed=3, scale=3.0)
    return (_with_extreme_rows(qkv) if extreme else qkv).to(dtype), meta


def positions() -> torch.Tensor:
    """[T] int64 positions of the tokens of SEQUENCES, in step order."""
    return torch.cat([torch.arange(start, start + count) for start, count, _ in SEQUENCES])


def nan_caches(spec: ModelSpec, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V caches whose every slot holds NaN, so a slot written by mistake shows."""
    k_cache, v_cache = new_kv_cache(NUM_BLOCKS, BLOCK, spec.num_kv_heads, spec.head_dim, dtype)
    return k_cache.fill_(float("nan")), v_cache.fill_(float("nan"))


# --- running a kernel


def run_norm(
    kernels: NativeKernels, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor
) -> Outputs:
    """-> (normed, the residual stream after the in-place add); `hidden` itself is left untouched."""
    updated = hidden.clone()
    return kernels.add_rms_norm(updated, delta, weight, EPS), updated


def run_rotary(
    kernels: NativeKernels, spec: ModelSpec, table: RotaryTable, qkv: torch.Tensor, meta: AttentionMetadata
) -> Outputs:
    """-> (rotated q [T, H, D] fp32, k cache, v cache), the caches NaN except the slots written."""
    k_cache, v_cache = nan_caches(spec, qkv.dtype)
    q = kernels.rotary_write_kv(
        qkv, positions(), table.cos, table.sin, meta.write_blocks, meta.write_offsets, k_cache, v_cache,
        spec.num_heads,
    )  # fmt: skip
    return q, k_cache, v_cache


def torch_rotary(spec: ModelSpec, table: RotaryTable, qkv: torch.Tensor, meta: AttentionMetadata) -> Outputs:
    """The torch path of the decoder: RotaryTable.apply on q and k, write_kv -> (q, k cache, v cache)."""
    tokens, heads, kv_heads, dim = qkv.shape[0], spec.num_heads, spec.num_kv_heads, spec.head_dim
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    k_cache, v_cache = nan_caches(spec, qkv.dtype)
    rotated_k = table.apply(k.reshape(tokens, kv_heads, dim), positions())
    write_kv(k_cache, v_cache, rotated_k, v.reshape(tokens, kv_heads, dim), meta)
    return table.apply(q.reshape(tokens, heads, dim), positions()), k_cache, v_cache


def assert_same_bits(got: Outputs, expected: Outputs, what: str) -> None:
    """Every tensor bitwise equal; the message names the first differing element."""
    for index, (a, b) in enumerate(zip(got, expected, strict=True)):
        differ = (bits(a) != bits(b)).nonzero()
        assert differ.numel() == 0, f"{what}: output {index} differs at {differ[0].tolist()} ({len(differ)})"


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Representable bf16 values between a and b (0 when equal; +0 and -0 count as equal)."""

    def ordered(x: torch.Tensor) -> torch.Tensor:
        raw = bits(x.to(torch.bfloat16)).long()
        return torch.where(raw < 0, -(raw & 0x7FFF), raw)

    return (ordered(a) - ordered(b)).abs()


# --- 1. rows do not depend on the batch, their position in it, or the thread count


def _row_probes(
    kernels: NativeKernels, spec: ModelSpec, dtype: torch.dtype
) -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]]:
    """op -> (row function as the self-check wraps it, 4 probe rows)."""
    width, inter = spec.hidden_size, spec.intermediate_size
    weight = (1.0 + 0.1 * _randn(width, seed=10)).to(dtype)
    qkv_width = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    ops = NativeBackend(Numerics(dtype, True, 4), kernels)
    return {
        "rms_norm": (norm_fn(ops, weight, EPS), _randn(4, 2 * width, seed=11).to(dtype)),
        "rms_norm_no_residual": (
            lambda x: kernels.add_rms_norm(x.clone(), None, weight, EPS),
            _randn(4, width, seed=12).to(dtype),
        ),
        "silu_mul": (ops.silu_mul, silu_inputs(inter, dtype, seed=13)[:4]),
        "rotary": (rotary_fn(ops, spec), _randn(4, qkv_width, seed=14).to(dtype)),
    }


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("shape", ["smollm2", "tiny"])
def test_rows_do_not_depend_on_the_batch(
    kernels: NativeKernels, shape: str, dtype_name: str, threads: int
) -> None:
    """Every kernel's row computed alone with one thread is bitwise equal to the same row at the first, a
    middle and the last position of random batches of 1..64 rows, with 1 and 2 threads."""
    for op, (fn, rows) in _row_probes(kernels, SPECS[shape], DTYPES[dtype_name]).items():
        assert row_mismatches(fn, rows, threads) == [], op


def test_negative_control_batch_statistics_are_caught() -> None:
    """The probe above can fail: RMSNorm whose mean of squares runs over the whole batch (not per row)
    gives a row different bits among different neighbours, and row_mismatches reports it."""
    weight = torch.ones(HIDDEN, dtype=torch.bfloat16)

    def batch_norm(x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean() + EPS)).to(x.dtype)

    rows = _randn(4, HIDDEN, seed=15).to(torch.bfloat16)
    assert len(row_mismatches(batch_norm, rows, threads=1)) > 10


# --- 2. the ISA flags change speed, not bits


@pytest.mark.skipif(not X86, reason="the alternative build uses an x86-64 -march level")
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("shape", list(SPECS))
def test_isa_flags_do_not_change_rms_norm_bits(
    kernels: NativeKernels, baseline: NativeKernels, shape: str, dtype_name: str
) -> None:
    """-march=x86-64 and -march=native builds: same normed rows and same in-place residual sum, with and
    without the residual add, including denormal, overflowing and all-zero rows."""
    hidden, delta, weight = norm_inputs(SPECS[shape].hidden_size, DTYPES[dtype_name])
    for residual in (delta, None):
        expected = run_norm(kernels, hidden, residual, weight)
        assert_same_bits(
            run_norm(baseline, hidden, residual, weight), expected, f"delta {residual is not None}"
        )


@pytest.mark.skipif(not X86, reason="the alternative build uses an x86-64 -march level")
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("shape", list(SPECS))
def test_isa_flags_do_not_change_silu_mul_bits(
    kernels: NativeKernels, baseline: NativeKernels, shape: str, dtype_name: str
) -> None:
    """Same bits from both builds, gates at the exp clamps (+-100, +-90, +-88, +-87), +-0 and denormals."""
    gate_up = silu_inputs(SPECS[shape].intermediate_size, DTYPES[dtype_name])
    assert_same_bits((baseline.silu_mul(gate_up),), (kernels.silu_mul(gate_up),), "silu_mul")


@pytest.mark.skipif(not X86, reason="the alternative build uses an x86-64 -march level")
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("shape", list(SPECS))
def test_isa_flags_do_not_change_rotary_bits(
    kernels: NativeKernels,
    baseline: NativeKernels,
    rotary_tables: dict[str, RotaryTable],
    shape: str,
    dtype_name: str,
) -> None:
    """Same rotated q and same cache contents (written slots and untouched NaN slots) from both builds,
    positions 0..8191, a denormal and a huge row."""
    spec, table = SPECS[shape], rotary_tables[shape]
    qkv, meta = rotary_inputs(spec, DTYPES[dtype_name], extreme=True)
    expected = run_rotary(kernels, spec, table, qkv, meta)
    assert_same_bits(run_rotary(baseline, spec, table, qkv, meta), expected, "rotary_write_kv")


def _has_fma() -> bool:
    """Whether this CPU has fused multiply-add (Linux /proc/cpuinfo)."""
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and " fma" in cpuinfo.read_text()


@pytest.mark.skipif(not (X86 and _has_fma()), reason="needs an x86-64 CPU with FMA")
def test_negative_control_fused_multiply_add_changes_bits(
    kernels: NativeKernels, flagged_build: Callable[[str], NativeKernels]
) -> None:
    """The comparisons above can see a difference: a build allowed to contract a * b + c into FMA (what
    -ffp-contract=off forbids) changes fp32 RMSNorm bits, and one whose exp rounds each product and sum
    apart (DETINF_TEST_SEPARATE_STEPS) changes silu_mul's. Contraction alone leaves silu_mul as it is: its
    exp's multiply-adds are all explicit fmaf calls, the same in every build."""
    fused = flagged_build("-ffp-contract=fast")
    other_exp = flagged_build("-DDETINF_TEST_SEPARATE_STEPS")
    hidden, delta, weight = norm_inputs(HIDDEN, torch.float32)
    norm_differ = bits(run_norm(fused, hidden, delta, weight)[0]) != bits(
        run_norm(kernels, hidden, delta, weight)[0]
    )
    gate_up = silu_inputs(INTER, torch.float32)
    silu_differ = bits(other_exp.silu_mul(gate_up)) != bits(kernels.silu_mul(gate_up))
    assert int(norm_differ.sum()) > 100 and int(silu_differ.sum()) > 100


# --- 3. numerics against the torch path


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("shape", list(SPECS))
def test_rotary_write_kv_equals_the_torch_path_bitwise(
    kernels: NativeKernels, rotary_tables: dict[str, RotaryTable], shape: str, dtype_name: str
) -> None:
    """q equals RotaryTable.apply (HF's rounding in the model dtype) bit for bit, as fp32 copies of
    model-dtype values; both caches equal what write_kv stores, slot for slot (unwritten slots stay NaN)."""
    spec, table, dtype = SPECS[shape], rotary_tables[shape], DTYPES[dtype_name]
    qkv, meta = rotary_inputs(spec, dtype, extreme=False)
    q, k_cache, v_cache = run_rotary(kernels, spec, table, qkv, meta)
    torch_q, torch_k, torch_v = torch_rotary(spec, table, qkv, meta)
    assert q.dtype == torch.float32 and torch.equal(bits(q.to(dtype).float()), bits(q))
    assert_same_bits((q.to(dtype), k_cache, v_cache), (torch_q, torch_k, torch_v), "native vs torch")
    assert bool(k_cache[[2, 5]].isnan().all()) and bool(v_cache[[2, 5]].isnan().all())


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("shape", list(SPECS))
def test_add_rms_norm_matches_the_torch_formula(kernels: NativeKernels, shape: str, dtype_name: str) -> None:
    """The in-place residual equals torch's hidden + delta bitwise; the normed rows are within one bf16 ulp
    (bf16) or 1e-6 relative (fp32) of ops/norm.rms_norm, denormal, overflowing and zero rows included;
    without delta, hidden is left unchanged."""
    dtype = DTYPES[dtype_name]
    hidden, delta, weight = norm_inputs(SPECS[shape].hidden_size, dtype, seed=20)
    for residual in (delta, None):
        normed, updated = run_norm(kernels, hidden, residual, weight)
        expected = hidden if residual is None else hidden + residual
        assert torch.equal(bits(updated), bits(expected))
        reference = rms_norm(expected, weight, EPS)
        if dtype == torch.bfloat16:
            assert int(ulp_distance(normed, reference).max()) <= 1
        else:
            torch.testing.assert_close(normed, reference, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("shape", list(SPECS))
def test_silu_mul_matches_f_silu(kernels: NativeKernels, shape: str, dtype_name: str) -> None:
    """Away from the clamps: within one bf16 ulp of F.silu(gate.float()) * up (fp32: 2e-6 relative), and
    in bf16 also within one ulp of HF's bf16 formula F.silu(gate) * up."""
    dtype, inter = DTYPES[dtype_name], SPECS[shape].intermediate_size
    gate_up = _randn(32, 2 * inter, seed=30, scale=4.0).to(dtype)
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    out = kernels.silu_mul(gate_up)
    reference = F.silu(gate.float()) * up.float()
    if dtype == torch.bfloat16:
        assert int(ulp_distance(out, reference).max()) <= 1
        assert int(ulp_distance(out, F.silu(gate) * up).max()) <= 1
    else:
        torch.testing.assert_close(out, reference, rtol=2e-6, atol=0.0)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_silu_mul_at_the_clamps_zeros_and_denormals(kernels: NativeKernels, dtype_name: str) -> None:
    """Large positive gates give exactly gate * up rounded; gates <= -87 a finite tiny value of sign
    -sign(up) (the clamp keeps exp(-gate) finite: no NaN from inf/inf); +-0 gives a zero of the sign of
    gate * up; denormal gates give round(round(gate / 2) * up), exactly as computed in torch."""
    dtype = DTYPES[dtype_name]
    gates = torch.tensor(SPECIAL_GATES + TINY_GATES).repeat(2).to(dtype)
    ups = torch.cat([torch.full((gates.numel() // 2,), 1.5), torch.full((gates.numel() // 2,), -2.75)]).to(
        dtype
    )
    out = kernels.silu_mul(torch.cat([gates, ups]).unsqueeze(0))[0]
    g, u, o = gates.float(), ups.float(), out.float()
    large, negative, zero = g >= 20, g <= -87, g == 0
    tiny = (g.abs() < 1e-30) & ~zero
    assert bool(o.isfinite().all())
    assert torch.equal(bits(out[large]), bits((gates * ups)[large]))
    assert bool((o[negative] * u[negative].sign() < 0).all()) and bool((o[negative].abs() < 1e-30).all())
    assert bool((o[zero] == 0).all())
    assert torch.equal(out[zero].signbit(), gates[zero].signbit() ^ ups[zero].signbit())
    expected_tiny = ((g / 2).to(dtype).float() * u).to(dtype)
    assert torch.equal(bits(out[tiny]), bits(expected_tiny[tiny]))


def _silu_mul_raw(kernels: NativeKernels, gate_up: torch.Tensor, table: torch.Tensor | None) -> torch.Tensor:
    """detinf_silu_mul on bf16 gate_up [M, 2I] with `table` (None: every value computed)."""
    out = torch.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=torch.bfloat16)
    pointer = None if table is None else table.data_ptr()
    rows, inter = out.shape
    kernels.library.detinf_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, inter, 1, pointer)
    return out


@pytest.mark.parametrize("inter", [INTER, 8195])
def test_silu_table_gives_the_computed_bits_for_every_bf16_gate(kernels: NativeKernels, inter: int) -> None:
    """silu_mul reads silu of a bf16 gate from a table of all 65536 (rowwise.c detinf_silu_table): for every
    gate bit pattern (NaNs, infinities, denormals, both zeros) times ups of both signs, tiny and huge
    ones included, the bits equal those of computing each value, in the AVX-512 loop and its scalar tail
    (rows of 1536 and of 8195 values). Negative control: a table with one entry off by one ulp is caught."""
    gates = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    generator = torch.Generator().manual_seed(7)
    ups = torch.randn(65536, generator=generator) * torch.tensor([1e-38, 1e-3, 1.0, 1e30]).repeat(16384)
    pad = -65536 % inter  # whole rows; the padding gates repeat the first ones
    gate_rows = torch.cat([gates, gates[:pad]]).view(-1, inter)
    up_rows = torch.cat([ups, ups[:pad]]).to(torch.bfloat16).view(-1, inter)
    gate_up = torch.cat([gate_rows, up_rows], dim=1).contiguous()
    computed = _silu_mul_raw(kernels, gate_up, None)
    assert torch.equal(bits(_silu_mul_raw(kernels, gate_up, kernels.silu_table)), bits(computed))
    assert torch.equal(bits(kernels.silu_mul(gate_up)), bits(computed))
    wrong = kernels.silu_table.clone()
    wrong[0x3F82] += 1  # the gate 1.015625, whose up has scale 1 (index 2 mod 4)
    assert not torch.equal(bits(_silu_mul_raw(kernels, gate_up, wrong)), bits(computed))
