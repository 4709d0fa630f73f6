"""The ggml type table that GGUF reading uses equals the `gguf` package's, type by type."""

from __future__ import annotations

import gguf

from deterministic_inference.ops.ggml_types import BLOCK_GEOMETRY, GGMLType


def test_every_type_matches_the_gguf_package_by_id_name_and_block_geometry() -> None:
    ours = {(int(kind), kind.name, BLOCK_GEOMETRY[kind]) for kind in GGMLType}
    theirs = {
        (int(kind), kind.name, tuple(gguf.GGML_QUANT_SIZES[kind])) for kind in gguf.GGMLQuantizationType
    }
    assert ours == theirs
    assert set(BLOCK_GEOMETRY) == set(GGMLType)


def test_gguf_package_functions_accept_our_type() -> None:
    """Tests hand a tensor's type straight to `gguf.quants.dequantize`; an IntEnum of the same id works."""
    assert gguf.GGML_QUANT_SIZES[GGMLType.Q4_K] == (256, 144)  # type: ignore[index]
    assert GGMLType.Q8_0 == gguf.GGMLQuantizationType.Q8_0
