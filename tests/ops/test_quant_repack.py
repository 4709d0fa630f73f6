"""Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K repacked at load (ops/repack.py, csrc/quant_repack.c): the GEMM over
the repacked copy gives the stored layout's bits for every row count, row order, part mix and thread
count; a file-mapped weight's pages are given back while its bytes stay readable. Row, thread and build
invariance of the repacked path run in test_quant_invariance.py (its cases in these formats are repacked
on builds that repack)."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from deterministic_inference.ops.native import NativeKernels
from deterministic_inference.ops.quant import FORMATS, TEST_REVERSE, QuantizedWeight, QuantLinear
from deterministic_inference.ops.quant_probe import random_weight
from deterministic_inference.ops.repack import _library, give_back_superseded, repacked, stored_rows
from deterministic_inference.ops.weights import Embedding, RowOrdered
from tests.ops.helpers import bits, num_threads
from tests.ops.quant_reference import documented_output

K = 1280  # 40 blocks: 2.5 chunks of 16 units (the many-row path's last chunk is partial)
REPACKED = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


@pytest.fixture(scope="module")
def repacking(kernels: NativeKernels) -> NativeKernels:
    """The default build; these tests need one that repacks REPACKED (the AVX-512 VNNI build)."""
    if not all(_library(kernels).detinf_quant_repacks(FORMATS[name].ggml_type) for name in REPACKED):
        pytest.skip("this build reads these formats as stored (no AVX-512 VNNI)")
    return kernels


def _parts(seed: int, k: int = K) -> tuple[list[QuantizedWeight], list[torch.Tensor | None]]:
    """q/k/v-like parts of k values: Q4_0 through a row order, Q8_0, Q4_1 of 48 rows (a panel of one half),
    Q4_0."""
    generator = torch.Generator().manual_seed(seed)
    shapes = (("Q4_0", 64), ("Q8_0", 32), ("Q4_1", 48), ("Q4_0", 16))
    parts = [random_weight(name, rows, k, generator) for name, rows in shapes]
    orders: list[torch.Tensor | None] = [torch.randperm(64, generator=generator), None, None, None]
    return parts, orders


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# odd blocks: the last pair of the repacked layout holds one block
@pytest.mark.parametrize("k", [K, K + 32], ids=["even-blocks", "odd-blocks"])
def test_repacked_parts_give_the_stored_bits(
    repacking: NativeKernels, out_dtype: torch.dtype, k: int
) -> None:
    parts, orders = _parts(seed=3, k=k)
    bias = torch.randn(160, generator=torch.Generator().manual_seed(4))
    repacked = QuantLinear(repacking, parts, bias=bias, out_dtype=out_dtype, row_orders=orders)
    stored = QuantLinear(repacking, parts, bias=bias, out_dtype=out_dtype, row_orders=orders, repack=False)
    assert (repacked.repacked_parts, stored.repacked_parts) == (4, 0)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(5)).bfloat16()
    for threads in (1, 2):
        with num_threads(threads):
            # repacked: the few-row loops, 4 rows at a time up to fused_row_limit (12 to 64 rows by format),
            # then the unpacking path; stored: the few-row loops up to 4 rows, then the unpacking path
            for rows in (1, 2, 3, 4, 5, 9, 13, 33, 70):
                assert torch.equal(bits(repacked(x[:rows])), bits(stored(x[:rows]))), (threads, rows)


@pytest.mark.parametrize("k", [K, K + 32], ids=["even-blocks", "odd-blocks"])
def test_the_unpacking_path_reads_the_repacked_layout_as_stored(repacking: NativeKernels, k: int) -> None:
    """The many-row path's unpacking of a repacked panel (which AMX builds take from 16 rows) gives the
    stored layout's bits: TEST_REVERSE sends every row count through it on any build."""
    parts, orders = _parts(seed=11, k=k)
    fp32 = torch.float32
    repacked = QuantLinear(repacking, parts, bias=None, out_dtype=fp32, row_orders=orders)
    stored = QuantLinear(repacking, parts, bias=None, out_dtype=fp32, row_orders=orders, repack=False)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(12)).bfloat16()
    for rows in (1, 5, 20):
        from_repacked = repacked.forward_with_flags(x[:rows], TEST_REVERSE)
        assert torch.equal(bits(from_repacked), bits(stored.forward_with_flags(x[:rows], TEST_REVERSE))), rows


@pytest.mark.parametrize("name", REPACKED)
def test_repacked_parts_are_the_documented_sequence(repacking: NativeKernels, name: str) -> None:
    weight = random_weight(name, 80, K, torch.Generator().manual_seed(6))
    x = torch.randn(6, K, generator=torch.Generator().manual_seed(7))
    linear = QuantLinear(repacking, [weight], bias=None, out_dtype=torch.float32)
    assert linear.repacked_parts == 1
    for rows in (1, 4, 6):
        assert torch.equal(bits(linear(x[:rows])), bits(documented_output(x[:rows], weight, None))), rows


@pytest.mark.parametrize(
    ("part", "byte"),
    # Q4_0: block 0's scale, column 0; Q8_0: block 0's first quant byte, column 0 (past the first pair's two
    # fields of 32 bytes); Q4_1: block 0's min, column 1 (past the pair's two d fields)
    [(0, 0), (1, 64), (2, 64 + 2)],
    ids=["q4_0-scale", "q8_0-quant", "q4_1-min"],
)
def test_negative_control_a_damaged_repacked_copy_is_detected(
    repacking: NativeKernels, part: int, byte: int
) -> None:
    """The comparison above can fail: one bit of one field of the repacked copy changed shows in both
    paths (fused few-row and unpacking)."""
    parts, orders = _parts(seed=3)
    fp32 = torch.float32
    repacked = QuantLinear(repacking, parts, bias=None, out_dtype=fp32, row_orders=orders)
    stored = QuantLinear(repacking, parts, bias=None, out_dtype=fp32, row_orders=orders, repack=False)
    repacked._repacked[part].view(-1)[byte] ^= 0x01  # the lowest bit: a field's mantissa, or a quant value
    x = torch.randn(6, K, generator=torch.Generator().manual_seed(5))
    for rows in (1, 6):
        assert not torch.equal(bits(repacked(x[:rows])), bits(stored(x[:rows]))), rows


@pytest.mark.parametrize(
    ("name", "byte"),
    # Q4_K / Q5_K: piece 0 holds each column's d, dmin and scales: byte 0 is column 0's d (lowest mantissa
    # bit); piece 1 (at 256) starts column 0's first quant bytes (Q4_K) or fifth bits (Q5_K). Q6_K, its pieces
    # in the order its loops read them: the scales (stored piece 12, at 0), the first half's qh (8 and 9,
    # column 0's first at 256) and ql (0 to 3, from 768), the second half's; then, past both super-blocks'
    # 13 pieces of the first pair, the 16 columns' d (column 0's at 2 x 3328)
    [("Q4_K", 0), ("Q4_K", 256), ("Q5_K", 256), ("Q6_K", 768), ("Q6_K", 256), ("Q6_K", 0), ("Q6_K", 6656)],
    ids=["q4_k-d", "q4_k-quant", "q5_k-high-bits", "q6_k-low-bits", "q6_k-high-bits", "q6_k-scale", "q6_k-d"],
)
def test_negative_control_a_damaged_repacked_k_panel_is_detected(
    repacking: NativeKernels, name: str, byte: int
) -> None:
    """The same for the K formats' transposed pieces: one changed bit shows in both paths."""
    weight = random_weight(name, 32, K, torch.Generator().manual_seed(8))
    repacked = QuantLinear(repacking, [weight], bias=None, out_dtype=torch.float32)
    stored = QuantLinear(repacking, [weight], bias=None, out_dtype=torch.float32, repack=False)
    x = torch.randn(6, K, generator=torch.Generator().manual_seed(9))
    assert torch.equal(bits(repacked(x)), bits(stored(x)))  # the same bits before the damage
    repacked._repacked[0].view(-1)[byte] ^= 0x01
    for rows in (1, 6):
        assert not torch.equal(bits(repacked(x[:rows])), bits(stored(x[:rows]))), rows


def _resident_kib(address: int) -> int:
    """Rss of the mapping of this process that contains `address` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for index, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(part, 16) for part in head.split("-"))
            if start <= address < end:
                rss = next(entry for entry in lines[index + 1 :] if entry.startswith("Rss:"))
                return int(rss.split()[1])
    raise AssertionError("no mapping holds the address")


def _file_mapped_q4_0(seed: int, tmp_path: Path) -> tuple[QuantizedWeight, torch.Tensor, QuantizedWeight]:
    """A random 4096 x 2048 Q4_0 weight (4.5 MiB), its bytes as a view on a private map of a file (as the
    GGUF loader maps files), and a file-mapped QuantizedWeight over that view."""
    weight = random_weight("Q4_0", 4096, 2048, torch.Generator().manual_seed(seed))
    path = tmp_path / "weights.bin"
    path.write_bytes(weight.data.numpy().tobytes())
    with open(path, "rb") as handle:
        region = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    data = torch.frombuffer(region, dtype=torch.uint8).view(weight.data.shape)
    return weight, data, QuantizedWeight(data, weight.fmt, weight.shape, file_mapped=True)


def test_a_file_mapped_weight_gives_its_pages_back_and_stays_readable(
    repacking: NativeKernels, tmp_path: Path
) -> None:
    weight, data, mapped = _file_mapped_q4_0(8, tmp_path)
    assert int(data.sum()) == int(weight.data.sum())  # every page read: resident
    before = _resident_kib(data.data_ptr())
    linear = QuantLinear(repacking, [mapped], bias=None, out_dtype=torch.float32)
    after = _resident_kib(data.data_ptr())
    assert before >= 4500 and after <= 64, (before, after)
    assert torch.equal(data, weight.data)  # the bytes read back from the file
    rows = torch.tensor([0, 17, 4095])
    assert torch.equal(bits(mapped.dequantize(rows)), bits(weight.dequantize(rows)))  # a tied embedding
    x = torch.randn(2, 2048, generator=torch.Generator().manual_seed(9))
    reference = QuantLinear(repacking, [weight], bias=None, out_dtype=torch.float32, repack=False)
    assert torch.equal(bits(linear(x)), bits(reference(x)))
    own = QuantLinear(repacking, [weight], bias=None, out_dtype=torch.float32)  # not file-mapped: kept
    assert own.repacked_parts == 1 and int(weight.data.sum()) == int(data.sum())


def test_pages_read_again_after_repacking_are_given_back_once_the_model_is_built(
    repacking: NativeKernels, tmp_path: Path
) -> None:
    """Faulting in a neighbour maps pages of a repacked tensor back in; give_back_superseded (called by
    the engine once every linear is built) drops them again, and only from repacked file-mapped
    weights (expert stacks included)."""
    weight, data, mapped = _file_mapped_q4_0(10, tmp_path)
    QuantLinear(repacking, [mapped], bias=None, out_dtype=torch.float32)
    assert mapped.superseded and not weight.superseded  # only file-mapped weights are marked
    assert int(data.sum()) == int(weight.data.sum())  # read again: resident
    assert _resident_kib(data.data_ptr()) >= 4500
    give_back_superseded([(mapped,), RowOrdered(weight, torch.arange(4096))])
    assert _resident_kib(data.data_ptr()) <= 64
    assert torch.equal(data, weight.data)


def test_a_tied_table_is_looked_up_in_its_repacked_copy_without_touching_the_map(
    repacking: NativeKernels, tmp_path: Path
) -> None:
    """Once the logits GEMM reads a repacked copy, an embedding lookup reads its rows back from that copy:
    the rows keep their bits and the file's pages stay given back. Negative control: the same rows read
    from the map fault its pages in, so the residency check can fail."""
    weight, data, mapped = _file_mapped_q4_0(11, tmp_path)
    QuantLinear(repacking, [mapped], bias=None, out_dtype=torch.float32)  # the tied head's repacked copy
    assert mapped.panels is not None
    ids = torch.arange(0, 4096, 64)  # 64 rows, one every 72 KiB
    for dtype in (torch.float32, torch.bfloat16):
        rows = Embedding(mapped, dtype)(ids)
        assert torch.equal(bits(rows), bits(weight.dequantize(ids, dtype=dtype)))
    assert _resident_kib(data.data_ptr()) <= 64
    mapped.dequantize(ids)  # negative control: the rows read from the map
    assert _resident_kib(data.data_ptr()) >= 64 * 4


@pytest.mark.parametrize("name", REPACKED)
def test_stored_rows_read_back_from_the_repacked_copy_are_the_stored_bytes(
    repacking: NativeKernels, name: str
) -> None:
    """Any rows, in any order and repeated, come back byte for byte; one damaged byte of the copy shows
    (negative control)."""
    weight = random_weight(name, 80, K, torch.Generator().manual_seed(12))
    weight.panels = repacked(repacking, weight, None)
    assert weight.panels is not None
    ids = torch.tensor([79, 0, 17, 17, 64, 15, 16, 5])
    assert torch.equal(stored_rows(repacking, weight, ids), weight.data[ids])
    weight.panels.view(-1)[weight.row_bytes * 16 + 3] ^= 0x10  # panel 1 (rows 16..31)
    assert not torch.equal(stored_rows(repacking, weight, torch.arange(16, 32)), weight.data[16:32])
    assert torch.equal(stored_rows(repacking, weight, torch.arange(16)), weight.data[:16])  # panel 0 intact


def test_stored_rows_refuses_rows_out_of_range_and_weights_without_a_copy(repacking: NativeKernels) -> None:
    weight = random_weight("Q4_0", 32, K, torch.Generator().manual_seed(13))
    with pytest.raises(ValueError, match="no repacked copy"):
        stored_rows(repacking, weight, torch.tensor([0]))
    weight.panels = repacked(repacking, weight, None)
    for ids in (torch.tensor([32]), torch.tensor([-1]), torch.tensor([1.0])):
        with pytest.raises(ValueError, match="stored_rows"):
            stored_rows(repacking, weight, ids)
