"""The compiled attention kernel (ops/native.py, ops/csrc/attention.c): builds for different ISAs give the
same bits, its exp and attention are accurate against float64, a row's bits do not depend on the row range
of the call, bad inputs are refused, and builds are cached by source, flags and compiler.

Every build goes to a pytest temporary directory, never to the user's cache."""

from __future__ import annotations

import hashlib
import math
import platform
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from deterministic_inference.ops import native_build
from deterministic_inference.ops.attention import (
    AttentionMetadata,
    new_kv_cache,
    paged_attention,
    sequence_kv,
    write_kv,
)
from deterministic_inference.ops.native import NativeKernels
from deterministic_inference.ops.native_build import ISA_FLAGS, NativeBuildError, build
from tests.ops.helpers import HEAD_DIM, HEADS, KV_HEADS, TINY_HEAD_DIM, TINY_HEADS, TINY_KV_HEADS, bits

X86 = platform.machine().lower() in ("x86_64", "amd64")
# (heads, KV heads, head dim): SmolLM2, the tiny test models, a head dim that is not a multiple of 16
# (the kernel's scalar value loop), and 16 query heads on one KV head (a tile's rows of one KV head span
# more than one group of rows sharing a load).
HEAD_SHAPES = {
    "smollm2": (HEADS, KV_HEADS, HEAD_DIM),
    "tiny": (TINY_HEADS, TINY_KV_HEADS, TINY_HEAD_DIM),
    "dim24": (2, 1, 24),
    "mqa16": (16, 1, 16),
}
# with smollm2, the q8_0 cache's shapes (head_dim a multiple of 32; tests/ops/test_attention_q8.py)
Q8_HEAD_SHAPES = {"smollm2": HEAD_SHAPES["smollm2"], "dim32": (4, 2, 32), "mqa32": (16, 1, 32)}
BLOCK_SIZES = (16, 8)  # 16: the vectorised score path; 8: the generic path
LENGTHS = (1, 15, 16, 17, 100)  # around one and two blocks, and a long one
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Case:
    """Sequences of LENGTHS in scattered blocks of a cache whose unused slots hold NaN; every position of
    every sequence is a query row (a whole prefill), T = sum(LENGTHS) rows."""

    q: torch.Tensor  # [T, H, D] fp32
    k_cache: torch.Tensor  # [num_blocks, KVH, D, block]
    v_cache: torch.Tensor  # [num_blocks, KVH, block, D]
    meta: AttentionMetadata
    tables: tuple[tuple[int, ...], ...]  # each sequence's block table
    scale: float


def make_case(dtype: torch.dtype, head_shape: str, block: int, seed: int = 0) -> Case:
    """Random keys, values and queries (see Case); NaN in every slot no sequence owns (dtype torch.int8: a
    q8_0 cache, head_dim a multiple of 32)."""
    heads, kv_heads, head_dim = {**HEAD_SHAPES, **Q8_HEAD_SHAPES}[head_shape]
    generator = torch.Generator().manual_seed(seed)
    per_seq = [-(-length // block) for length in LENGTHS]
    num_blocks = sum(per_seq) + 3  # a few blocks no sequence uses
    k_cache, v_cache = new_kv_cache(num_blocks, block, kv_heads, head_dim, dtype)
    unused = -1 if dtype == torch.int8 else float("nan")  # q8_0: all-ones bytes, NaN scales
    k_cache.fill_(unused)
    v_cache.fill_(unused)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = []
    for count in per_seq:
        tables.append(tuple(order[:count]))
        order = order[count:]
    meta = AttentionMetadata.build([(0, n, t) for n, t in zip(LENGTHS, tables, strict=True)], block)
    total = sum(LENGTHS)
    k = torch.randn(total, kv_heads, head_dim, generator=generator)  # [T, KVH, D]
    v = torch.randn(total, kv_heads, head_dim, generator=generator)
    write_kv(k_cache, v_cache, k, v, meta)
    q = 2 * torch.randn(total, heads, head_dim, generator=generator)  # [T, H, D]: peaky softmax
    return Case(q, k_cache, v_cache, meta, tuple(tables), head_dim**-0.5)


def call_kernel(
    kernels: NativeKernels,
    case: Case,
    out: torch.Tensor,  # [T, H, D] fp32
    rows: tuple[int, int] | None = None,
    tile: int = 0,
) -> None:
    """The kernel on the case's inputs, writing rows [first, end) of `out` (default all)."""
    m = case.meta
    kernels.attention(
        case.q, case.k_cache, case.v_cache, m.block_ids, m.row_table, m.row_keys, case.scale, out,
        rows=rows, tile=tile,
    )  # fmt: skip


def run_kernel(
    kernels: NativeKernels, case: Case, rows: tuple[int, int] | None = None, tile: int = 0
) -> torch.Tensor:
    """The kernel's fp32 output [T, H, D]; rows it does not compute stay NaN."""
    out = torch.full(case.q.shape, float("nan"))
    call_kernel(kernels, case, out, rows, tile)
    return out


def reference_attention(case: Case) -> torch.Tensor:
    """Causal softmax attention in float64 from the cache contents -> [T, H, D] float64."""
    outputs: list[torch.Tensor] = []
    for length, table in zip(LENGTHS, case.tables, strict=True):
        rows = case.meta.sequences[len(outputs)]
        keys, values = (x.double() for x in sequence_kv(case.k_cache, case.v_cache, table, length))
        group = case.q.shape[1] // keys.shape[0]
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)  # [H, L, D]
        q = case.q[rows.first_row : rows.first_row + rows.num_rows].double()  # [L, H, D]
        scores = torch.einsum("thd,hld->htl", q, keys) * case.scale  # [H, L, L]
        causal = torch.arange(length).view(1, -1) <= torch.arange(length).view(-1, 1)  # [L(query), L(key)]
        probs = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1)
        outputs.append(torch.einsum("htl,hld->thd", probs, values))
    return torch.cat(outputs)


# --- a. the ISA changes speed, not bits


@pytest.mark.skipif(not X86, reason="the alternative builds use x86-64 -march levels")
@pytest.mark.parametrize("block", BLOCK_SIZES)
@pytest.mark.parametrize("head_shape", list(HEAD_SHAPES))
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_isa_flags_do_not_change_bits(
    kernels: NativeKernels,
    march_builds: dict[str, NativeKernels],
    dtype_name: str,
    head_shape: str,
    block: int,
) -> None:
    case = make_case(DTYPES[dtype_name], head_shape, block)
    expected = bits(run_kernel(kernels, case))
    for name, other in march_builds.items():
        differing = (bits(run_kernel(other, case)) != expected).flatten(1).any(1).nonzero().flatten()
        assert differing.numel() == 0, f"{name} vs native: rows {differing.tolist()} differ"


@pytest.mark.skipif(not X86, reason="the alternative builds use x86-64 -march levels")
def test_negative_control_another_exp_changes_bits(
    kernels: NativeKernels, flagged_build: Callable[[str], NativeKernels]
) -> None:
    """The comparison above can see a difference: a build whose exp rounds each product and sum apart
    (DETINF_TEST_SEPARATE_STEPS: an ulp off now and then) changes the bits of most rows. (FMA contraction,
    the control this once used, no longer changes anything: every multiply-add of this kernel is an explicit
    fmaf. -ffast-math is no control either: its library sets flush-to-zero for the loading thread.)"""
    other = flagged_build("-DDETINF_TEST_SEPARATE_STEPS")
    case = make_case(torch.float32, "smollm2", 16)
    differing = (bits(run_kernel(other, case)) != bits(run_kernel(kernels, case))).flatten(1).any(1)
    assert int(differing.sum()) > case.q.shape[0] // 2


@pytest.mark.skipif(not X86, reason="the alternative builds use x86-64 -march levels")
def test_isa_flags_do_not_change_exp_bits(
    kernels: NativeKernels, march_builds: dict[str, NativeKernels]
) -> None:
    grid = torch.linspace(-87.0, 0.0, 20001).tolist()
    expected = [kernels.exp(x) for x in grid]
    for name, other in march_builds.items():
        assert [other.exp(x) for x in grid] == expected, name


# --- b. accuracy against float64


def test_exp_relative_error_below_3e7(kernels: NativeKernels) -> None:
    edges = torch.tensor([-87.0, -0.0, -(2.0**-30), -math.log(2) / 2, -math.log(2) * 1.5])
    grid = torch.cat([torch.linspace(-87.0, 0.0, 200001), edges]).tolist()  # fp32 values, as the kernel sees
    worst = max((abs(kernels.exp(x) - math.exp(x)) / math.exp(x), x) for x in grid)
    assert worst[0] < 3e-7, f"relative error {worst[0]:.3g} at x={worst[1]!r}"
    assert kernels.exp(0.0) == 1.0  # the row maximum's weight is exactly 1


@pytest.mark.parametrize("block", BLOCK_SIZES)
@pytest.mark.parametrize("head_shape", list(HEAD_SHAPES))
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_attention_matches_float64_reference(
    kernels: NativeKernels, dtype_name: str, head_shape: str, block: int
) -> None:
    case = make_case(DTYPES[dtype_name], head_shape, block)
    out = paged_attention(case.q, case.k_cache, case.v_cache, case.meta, scale=case.scale, kernels=kernels)
    assert out.dtype == torch.float32 and bool(out.isfinite().all())  # no NaN from unused slots
    error = (out.double() - reference_attention(case)).abs().max().item()
    assert error < 1e-5, f"max abs error {error:.3g}"


# --- c. a row's bits do not depend on the row range of the call


@pytest.mark.parametrize("block", BLOCK_SIZES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_rows_split_in_two_calls_equal_one_call(kernels: NativeKernels, dtype_name: str, block: int) -> None:
    case = make_case(DTYPES[dtype_name], "smollm2", block, seed=1)
    total = case.q.shape[0]
    whole = bits(run_kernel(kernels, case))
    for split in (0, 1, 15, 32, 49, 100, total - 1, total):
        first = run_kernel(kernels, case, rows=(0, split))
        assert bool(first[split:].isnan().all()), f"rows past {split} were written"
        call_kernel(kernels, case, first, rows=(split, total))
        assert torch.equal(bits(first), whole), f"split at row {split}"


def test_every_row_alone_equals_one_call(kernels: NativeKernels) -> None:
    case = make_case(torch.bfloat16, "tiny", 8, seed=2)
    whole = bits(run_kernel(kernels, case))
    for row in range(case.q.shape[0]):
        alone = bits(run_kernel(kernels, case, rows=(row, row + 1)))
        assert torch.equal(alone[row], whole[row]), f"row {row}"


# --- d. errors


def test_no_compiler_names_gcc(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(native_build.shutil, "which", lambda *_: None)
    with pytest.raises(NativeBuildError, match="gcc"):
        build(ISA_FLAGS, tmp_path)


def test_cc_is_honoured_and_a_missing_cc_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "gcc")
    assert native_build.compiler() == "gcc"
    monkeypatch.setenv("CC", "no-such-compiler-detinf")
    assert native_build.compiler() in ("cc", "gcc")


def test_source_that_fails_to_compile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    broken = tmp_path / "broken.c"
    broken.write_text("int detinf_attention(void) { return undeclared_name; }\n")
    monkeypatch.setattr(native_build, "SOURCES", (broken,))  # the others would only take time
    out_dir = tmp_path / "builds"
    with pytest.raises(NativeBuildError, match="failed"):
        build(ISA_FLAGS, out_dir)
    assert list(out_dir.rglob("*.so")) == []  # nothing half-built left to be loaded later


def test_objects_are_reused_where_a_define_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The object cache is keyed by the preprocessed source: a -D that one source reads gives it a new
    object and the other its old one; a changed header, or another -march, gives new ones."""
    monkeypatch.setenv("DETINF_CACHE_DIR", str(tmp_path))
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "shared.h").write_text("static inline int twice(int x) { return 2 * x; }\n")
    reads = csrc / "reads.c"
    reads.write_text('#include "shared.h"\n#ifdef DETINF_X\nint f(void) { return twice(1); }\n#endif\n')
    ignores = csrc / "ignores.c"
    ignores.write_text('#include "shared.h"\nint g(void) { return twice(2); }\n')
    monkeypatch.setattr(native_build, "_CSRC", csrc)
    cc, flags = native_build.compiler(), (*native_build.BASE_FLAGS, "-march=x86-64")
    defined = (*flags, "-DDETINF_X")
    version = native_build._compiler_version(cc)

    def objects(cc: str, flags: tuple[str, ...], source: Path) -> Path:
        return native_build._cached_object(cc, version, flags, source)  # the key is what is under test

    assert objects(cc, defined, reads) != objects(cc, flags, reads)
    assert objects(cc, defined, ignores) == objects(cc, flags, ignores)
    assert objects(cc, (*native_build.BASE_FLAGS, "-march=x86-64-v3"), ignores) != objects(cc, flags, ignores)
    assert objects(cc, flags, ignores).parent == tmp_path / "objects"
    before = objects(cc, flags, ignores)
    (csrc / "shared.h").write_text("static inline int twice(int x) { return x + x; }\n")
    assert objects(cc, flags, ignores) != before


def _valid_inputs() -> dict[str, Any]:
    """Arguments of NativeKernels.attention that pass every check (2 rows, 4 heads, 2 KV heads, D 16)."""
    k_cache, v_cache = new_kv_cache(2, 8, 2, 16, torch.float32)
    meta = AttentionMetadata.build([(0, 2, [1])], 8)
    return {
        "q": torch.zeros(2, 4, 16), "k_cache": k_cache, "v_cache": v_cache, "block_ids": meta.block_ids,
        "row_table": meta.row_table, "row_keys": meta.row_keys, "scale": 0.25, "out": torch.zeros(2, 4, 16),
    }  # fmt: skip


def _bad_inputs() -> Iterator[tuple[str, dict[str, Any], str]]:
    """(what is wrong, changed arguments, part of the expected message) for inputs the kernel must refuse."""
    valid = _valid_inputs()
    k_cache, v_cache = valid["k_cache"], valid["v_cache"]
    yield "bf16 q", {"q": valid["q"].bfloat16()}, "q and out must be fp32"
    yield "fp64 out", {"out": valid["out"].double()}, "q and out must be fp32"
    yield "out shape", {"out": torch.zeros(2, 4, 8)}, "same shape"
    yield "fp16 caches", {"k_cache": k_cache.half(), "v_cache": v_cache.half()}, "not a cache format"
    yield "mixed cache dtypes", {"v_cache": v_cache.bfloat16()}, "one format"
    yield "non-contiguous keys", {"k_cache": torch.zeros(2, 2, 8, 16).transpose(2, 3)}, "contiguous"
    yield "non-contiguous q", {"q": torch.zeros(2, 16, 4).transpose(1, 2)}, "contiguous"
    yield "non-contiguous block ids", {"block_ids": torch.zeros(4, dtype=torch.int64)[::2]}, "contiguous"
    yield "int32 block ids", {"block_ids": valid["block_ids"].int()}, "int64"
    yield "int32 row table", {"row_table": valid["row_table"].int()}, "int64"
    yield "int32 row keys", {"row_keys": valid["row_keys"].int()}, "int64"
    yield "values not [blocks, KVH, block, D]", {"v_cache": torch.zeros(2, 2, 16, 8)}, "match the key cache"
    yield "fewer value blocks", {"v_cache": v_cache[:1].clone()}, "match the key cache"
    q8_keys, q8_values = new_kv_cache(2, 8, 2, 16, torch.int8)  # head_dim 16: no whole q8_0 group
    yield "q8_0 with head dim 16", {"k_cache": q8_keys, "v_cache": q8_values}, "multiple of 32"
    yield "head dim differs from q", {"q": torch.zeros(2, 4, 8), "out": torch.zeros(2, 4, 8)}, "cache shapes"
    three_heads = {"q": torch.zeros(2, 3, 16), "out": torch.zeros(2, 3, 16)}
    yield "heads not a multiple of KV heads", three_heads, "cache shapes"
    yield "row keys shorter than q", {"row_keys": valid["row_keys"][:1].clone()}, "per-row tensors"
    yield "block id past the cache", {"block_ids": torch.tensor([2])}, "out of range"
    yield "negative block id", {"block_ids": torch.tensor([-1])}, "out of range"
    yield "table past block_ids", {"row_keys": torch.tensor([1, 9])}, "out of range"
    yield "row with no key", {"row_keys": torch.tensor([0, 1])}, "out of range"
    yield "window starting at its last key", {"row_first": valid["row_keys"].clone()}, "out of range"
    yield "negative window start", {"row_first": torch.tensor([-1, 0])}, "out of range"
    yield "window starts shorter than q", {"row_first": torch.tensor([0])}, "per-row tensors"
    yield "int32 window starts", {"row_first": torch.tensor([0, 0], dtype=torch.int32)}, "int64"


@pytest.mark.parametrize(
    ("problem", "changes", "message"), list(_bad_inputs()), ids=[p for p, *_ in _bad_inputs()]
)
def test_attention_refuses_inputs_it_would_misread(
    kernels: NativeKernels, problem: str, changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        kernels.attention(**{**_valid_inputs(), **changes})


@pytest.mark.parametrize("rows", [(0, 3), (2, 1), (-1, 1)])
def test_attention_refuses_a_bad_row_range(kernels: NativeKernels, rows: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="row range"):
        kernels.attention(**_valid_inputs(), rows=rows)


@pytest.mark.parametrize("tile", [-1, 9])
def test_attention_refuses_a_bad_tile(kernels: NativeKernels, tile: int) -> None:
    with pytest.raises(ValueError, match="tile"):
        kernels.attention(**_valid_inputs(), tile=tile)


def test_metadata_for_another_cache_is_refused(kernels: NativeKernels) -> None:
    k_cache, v_cache = new_kv_cache(3, 8, 2, 16, torch.float32)
    k = torch.zeros(2, 2, 16)  # [T, KVH, D]
    q = torch.zeros(2, 4, 16)  # [T, H, D]
    too_high = AttentionMetadata.build([(7, 2, [0, 3])], 8)  # block 3 of a 3-block cache
    other_block_size = AttentionMetadata.build([(0, 2, [1])], 16)
    for meta in (too_high, other_block_size):
        with pytest.raises(ValueError, match="does not fit"):
            write_kv(k_cache, v_cache, k, k, meta)
        for choice in (kernels, None):
            with pytest.raises(ValueError, match="does not fit"):
                paged_attention(q, k_cache, v_cache, meta, scale=0.25, kernels=choice)


# (start position, tokens, block table): tables too short for blocks of 8, no tokens, a negative start
BAD_CHUNKS = [(0, 9, [0]), (15, 2, [0, 1]), (0, 0, [0]), (-1, 1, [0])]


@pytest.mark.parametrize(("start", "count", "table"), BAD_CHUNKS)
def test_metadata_refuses_short_tables_and_empty_chunks(start: int, count: int, table: list[int]) -> None:
    with pytest.raises(ValueError, match="need"):
        AttentionMetadata.build([(start, count, table)], 8)


# --- e. the build cache


def test_second_build_reuses_the_library(kernels: NativeKernels, monkeypatch: pytest.MonkeyPatch) -> None:
    before = kernels.path.stat().st_mtime_ns
    commands: list[list[str]] = []
    real_run = subprocess.run

    def recording_run(command: list[str], **kwargs: Any) -> Any:
        commands.append(command)
        return real_run(command, **kwargs)

    monkeypatch.setattr(native_build.subprocess, "run", recording_run)
    assert build(ISA_FLAGS) == kernels.path
    assert commands, "the recorder saw no command (not even the compiler's --version)"
    assert kernels.path.stat().st_mtime_ns == before
    assert all("-o" not in command for command in commands), "the second build compiled again"


def test_library_name_depends_on_flags_and_source(
    kernels: NativeKernels, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The cache path (what `build` looks up before compiling) changes with a flag and with a source."""
    cc = native_build.compiler()
    assert native_build.library_path(cc, ISA_FLAGS) == kernels.path
    other = native_build.library_path(cc, (*ISA_FLAGS, "-DDETINF_TEST_FLAG=1"))
    assert other != kernels.path
    assert kernels.digest == kernels.path.stem.removeprefix("attention-")
    source_digest = native_build.source_digest()
    joined = b"\0".join(path.read_bytes() for path in (*native_build.SOURCES, *native_build.HEADERS))
    assert source_digest == hashlib.sha256(joined).hexdigest()[:16]
    changed = tmp_path / "attention.c"
    changed.write_bytes(native_build.SOURCES[0].read_bytes() + b"\n/* changed */\n")
    monkeypatch.setattr(native_build, "SOURCES", (changed, *native_build.SOURCES[1:]))
    assert native_build.source_digest() != source_digest
    assert native_build.library_path(cc, ISA_FLAGS).name not in (kernels.path.name, other.name)


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DETINF_CACHE_DIR", str(tmp_path))
    assert native_build.cache_dir() == tmp_path / "native"
