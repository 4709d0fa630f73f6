"""The compiled row-wise kernels (NativeKernels.add_rms_norm, .silu_mul, .rotary_write_kv) refuse inputs the
C code would misread (dtype, layout, index type, width, range) with a ValueError before the C code runs;
the unchanged arguments of every case are accepted, so each refusal comes from its one change."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deterministic_inference.ops.attention import new_kv_cache
from deterministic_inference.ops.native import NativeKernels
from deterministic_inference.ops.rope import RotaryTable

EPS = 1e-5


def _norm_args() -> dict[str, Any]:
    """Valid add_rms_norm arguments: 2 rows of width 16, fp32."""
    return {"hidden": torch.zeros(2, 16), "delta": torch.zeros(2, 16), "weight": torch.ones(16), "eps": EPS}


def _rotary_args() -> dict[str, Any]:
    """Valid rotary_write_kv arguments: 2 tokens, 4 heads, 2 KV heads, head dim 16, a 2-block cache of 8
    slots and an 8-position table, fp32."""
    k_cache, v_cache = new_kv_cache(2, 8, 2, 16, torch.float32)
    table = RotaryTable(16, 10000.0, 8, None)
    index = torch.tensor([0, 1])
    return {
        "qkv": torch.zeros(2, 8 * 16), "positions": index.clone(), "cos": table.cos, "sin": table.sin,
        "write_blocks": index.clone(), "write_offsets": index.clone(), "k_cache": k_cache, "v_cache": v_cache,
        "heads": 4,
    }  # fmt: skip


METHODS = {"norm": "add_rms_norm", "silu": "silu_mul", "rotary": "rotary_write_kv"}  # by case prefix


def _valid_args(method: str) -> dict[str, Any]:
    if method == "add_rms_norm":
        return _norm_args()
    return {"gate_up": torch.zeros(2, 32)} if method == "silu_mul" else _rotary_args()


def _bad_inputs() -> list[tuple[str, dict[str, Any], str]]:
    """(case, changed arguments, part of the expected message) for every refused input; the case's first
    word names the kernel (METHODS)."""
    zeros, tensor, rotary = torch.zeros, torch.tensor, _rotary_args()
    cos, sin, k_cache, v_cache = rotary["cos"], rotary["sin"], rotary["k_cache"], rotary["v_cache"]
    half = {"hidden": zeros(2, 16).half(), "delta": zeros(2, 16).half(), "weight": torch.ones(16).half()}
    half_rotary = {"qkv": rotary["qkv"].half(), "k_cache": k_cache.half(), "v_cache": v_cache.half()}
    return [
        ("norm fp16", half, "fp32 or bf16"),
        ("norm bf16 delta with fp32 hidden", {"delta": zeros(2, 16).bfloat16()}, "contiguous"),
        ("norm non-contiguous hidden", {"hidden": zeros(16, 2).t()}, "contiguous"),
        ("norm non-contiguous delta", {"delta": zeros(16, 2).t()}, "contiguous"),
        ("norm weight width", {"weight": torch.ones(17)}, r"weight \[W\]"),
        ("norm delta width", {"delta": zeros(2, 32)}, r"delta \[M, W\]"),
        ("norm 1-d hidden", {"hidden": zeros(16), "delta": None}, r"hidden \[M, W\]"),
        ("silu fp16", {"gate_up": zeros(2, 32).half()}, "fp32 or bf16"),
        ("silu non-contiguous", {"gate_up": zeros(32, 2).t()}, "contiguous"),
        ("silu odd width", {"gate_up": zeros(2, 33)}, r"2 \* intermediate"),
        ("silu 3-d", {"gate_up": zeros(2, 2, 32)}, r"2 \* intermediate"),
        ("rotary fp16", half_rotary, "fp32 or bf16"),
        ("rotary keys and values in two formats", {"k_cache": k_cache.bfloat16()}, "one format"),
        ("rotary non-contiguous qkv", {"qkv": zeros(128, 2).t()}, "contiguous"),
        ("rotary int32 positions", {"positions": rotary["positions"].int()}, "int64"),
        ("rotary int32 blocks", {"write_blocks": rotary["write_blocks"].int()}, "int64"),
        ("rotary int32 offsets", {"write_offsets": rotary["write_offsets"].int()}, "int64"),
        ("rotary non-contiguous positions", {"positions": tensor([0, 9, 1, 9])[::2]}, "contiguous"),
        ("rotary qkv width vs heads", {"heads": 3}, "qkv width"),
        ("rotary qkv width vs cache", {"qkv": zeros(2, 8 * 16 + 16)}, "qkv width"),
        ("rotary fp64 table", {"cos": cos.double(), "sin": sin.double()}, "cos and sin"),
        ("rotary table shapes", {"sin": sin[:4].clone()}, "cos and sin"),
        ("rotary non-contiguous table", {"cos": cos.t().contiguous().t()}, "cos and sin"),
        ("rotary position past the table", {"positions": tensor([0, 8])}, "out of range"),
        ("rotary block past the cache", {"write_blocks": tensor([0, 2])}, "out of range"),
        ("rotary negative position", {"positions": tensor([0, -1])}, "out of range"),
        ("rotary negative block", {"write_blocks": tensor([-1, 0])}, "out of range"),
        ("rotary offset past the block", {"write_offsets": tensor([0, k_cache.shape[3]])}, "out of range"),
        ("rotary short positions", {"positions": tensor([0])}, "one entry per token"),
        ("rotary value cache shape", {"v_cache": zeros(1, *v_cache.shape[1:])}, "value cache"),
        ("rotary table width", {"cos": zeros(8, 8), "sin": zeros(8, 8)}, "cos and sin"),
    ]


BAD_INPUTS = _bad_inputs()


@pytest.mark.parametrize(("case", "changes", "message"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_inputs_the_kernels_would_misread_are_refused(
    kernels: NativeKernels, case: str, changes: dict[str, Any], message: str
) -> None:
    """Wrong dtype, layout, index type, width or range raises ValueError before the C code runs."""
    method = METHODS[case.split()[0]]
    with pytest.raises(ValueError, match=message):
        getattr(kernels, method)(**{**_valid_args(method), **changes})


def test_valid_refusal_baselines_are_accepted(kernels: NativeKernels) -> None:
    """The refusal cases' unchanged arguments pass, so each refusal is caused by its one change."""
    assert kernels.add_rms_norm(**_norm_args()).shape == (2, 16)
    assert kernels.silu_mul(torch.zeros(2, 32)).shape == (2, 16)
    assert kernels.rotary_write_kv(**_rotary_args()).shape == (2, 4, 16)
