"""The KV cache formats (ops/kv_format.py, csrc/kv_q8.h): the q8_0 quantizer's rule on chosen values (ties to
even, zero groups, the clamp), the compiled cache write (rotary_write_kv) storing exactly the torch
quantizer's bytes for fp32 and bf16 models with 1 or 2 threads (a perturbed rule is seen), a bf16 cache
under an fp32 model, and the bytes per token the memory estimate counts."""

from __future__ import annotations

import pytest
import torch

from deterministic_inference.ops.attention import AttentionMetadata, new_kv_cache, write_kv
from deterministic_inference.ops.kv_format import (
    Q8_DTYPE,
    cache_bytes_per_token,
    cache_dtype,
    dequantized_cache,
    q8_views,
    quantize_q8_0,
)
from deterministic_inference.ops.native import NativeKernels
from deterministic_inference.ops.rope import RotaryTable
from tests.ops.helpers import THREADS, num_threads
from tests.ops.test_native_rowwise import BLOCK, NUM_BLOCKS, SPECS, positions, rotary_inputs

SPEC = SPECS["smollm2"]  # head_dim 64: two q8_0 groups per vector
MODEL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def group_of(*values: float) -> torch.Tensor:
    """One group of 32 fp32 values: `values` then zeros."""
    return torch.tensor([*values, *([0.0] * (32 - len(values)))])


def test_quantizer_rounds_ties_to_even_and_keeps_the_maximum_exact() -> None:
    """amax 127 -> scale 1: 2.5 -> 2, 3.5 -> 4, -2.5 -> -2, the maximum -> 127; an all-zero group gets scale
    0 and zeros; dequantized values are q * scale."""
    x = torch.stack([group_of(127.0, 2.5, 3.5, -2.5, -0.4), group_of()])  # [2, 32]
    values, scales = quantize_q8_0(x)
    assert scales.tolist() == [[1.0], [0.0]]
    assert values[0, :5].tolist() == [127, 2, 4, -2, 0] and not values[1].any()
    halved, half_scale = quantize_q8_0(x / 2)  # scale 63.5 / 127 = 0.5 exactly; the same integers
    assert torch.equal(halved, values) and half_scale.tolist() == [[0.5], [0.0]]


def test_quantizer_divides_in_fp32_by_the_group_maximum_over_127() -> None:
    x = group_of(-3.0, 1.0, 1.5)
    values, scales = quantize_q8_0(x)
    scale = torch.tensor(3.0) / torch.tensor(127.0)  # fp32 / fp32
    assert torch.equal(scales, scale.reshape(1))
    expected = torch.round(torch.tensor([-3.0, 1.0, 1.5]) / scale)  # fp32 divisions, ties to even
    assert values[:3].tolist() == [-127, *expected[1:].int().tolist()]


def native_write(
    kernels: NativeKernels, qkv: torch.Tensor, meta: AttentionMetadata, table: RotaryTable, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled rotary + cache write into a fresh `dtype` cache whose bytes are all ones."""
    k_cache, v_cache = new_kv_cache(NUM_BLOCKS, BLOCK, SPEC.num_kv_heads, SPEC.head_dim, dtype)
    k_cache.view(torch.uint8).fill_(255)
    v_cache.view(torch.uint8).fill_(255)
    kernels.rotary_write_kv(
        qkv, positions(), table.cos, table.sin, meta.write_blocks, meta.write_offsets, k_cache, v_cache,
        SPEC.num_heads,
    )  # fmt: skip
    return k_cache, v_cache


def model_dtype_values(qkv: torch.Tensor, table: RotaryTable) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotated k, v) [T, KVH, D] as the model dtype holds them (the torch path's rotation)."""
    heads, kv_heads, dim = SPEC.num_heads, SPEC.num_kv_heads, SPEC.head_dim
    _, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    tokens = qkv.shape[0]
    return table.apply(k.reshape(tokens, kv_heads, dim), positions()), v.reshape(tokens, kv_heads, dim)


@pytest.fixture(scope="module")
def table() -> RotaryTable:
    return RotaryTable(SPEC.head_dim, SPEC.rope_theta, 8192, None)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("model", list(MODEL_DTYPES))
def test_compiled_q8_write_stores_the_torch_quantizers_bytes(
    kernels: NativeKernels, table: RotaryTable, model: str, threads: int
) -> None:
    """37 tokens (the C loop runs them on every thread from 32 on): every byte of both caches equals
    write_kv's (quantize_q8_0 of the model-dtype k and v); unwritten slots keep their bytes."""
    qkv, meta = rotary_inputs(SPEC, MODEL_DTYPES[model], extreme=False)
    with num_threads(threads):
        k_cache, v_cache = native_write(kernels, qkv, meta, table, Q8_DTYPE)
    expected_k, expected_v = new_kv_cache(NUM_BLOCKS, BLOCK, SPEC.num_kv_heads, SPEC.head_dim, Q8_DTYPE)
    expected_k.view(torch.uint8).fill_(255)
    expected_v.view(torch.uint8).fill_(255)
    write_kv(expected_k, expected_v, *model_dtype_values(qkv, table), meta)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert bool((k_cache[[2]] == -1).all())  # block 2 is never written


def test_negative_control_a_reciprocal_scale_gives_other_bytes(
    kernels: NativeKernels, table: RotaryTable
) -> None:
    """The comparison above sees a scale computed as amax * (1 / 127) instead of amax / 127 (fp32 both):
    some stored scale differs."""
    qkv, meta = rotary_inputs(SPEC, torch.float32, extreme=False)
    k_cache, v_cache = native_write(kernels, qkv, meta, table, Q8_DTYPE)
    keys, _ = model_dtype_values(qkv, table)
    amax = keys.reshape(*keys.shape[:-1], -1, 32).abs().amax(-1)  # [T, KVH, D / 32]
    index = (meta.write_blocks, meta.write_offsets)
    stored = q8_views(k_cache, v_cache).key_scales.permute(0, 3, 1, 2)[index]  # [T, KVH, D / 32]
    assert torch.equal(stored, amax / 127.0)
    assert not torch.equal(stored, amax * (torch.tensor(1.0) / torch.tensor(127.0)))


def test_values_are_stored_with_their_rule_on_chosen_values(
    kernels: NativeKernels, table: RotaryTable
) -> None:
    """v is stored unrotated: a group with ties (amax 127 -> scale 1), a zero group, read back exactly."""
    qkv, meta = rotary_inputs(SPEC, torch.float32, extreme=False)
    dim, first_v = SPEC.head_dim, (SPEC.num_heads + SPEC.num_kv_heads) * SPEC.head_dim
    qkv[0, first_v : first_v + dim] = torch.cat([group_of(127.0, 2.5, 3.5, -2.5), group_of()])
    k_cache, v_cache = native_write(kernels, qkv, meta, table, Q8_DTYPE)
    views = q8_views(k_cache, v_cache)
    slot = (int(meta.write_blocks[0]), 0, int(meta.write_offsets[0]))  # token 0, KV head 0
    assert (
        views.value_values[slot][:4].tolist() == [127, 2, 4, -2] and not views.value_values[slot][32:].any()
    )
    assert views.value_scales[slot].tolist() == [1.0, 0.0]
    _, values = dequantized_cache(k_cache, v_cache)
    assert values[slot][:4].tolist() == [127.0, 2.0, 4.0, -2.0]


def test_bf16_cache_under_an_fp32_model_rounds_to_nearest_even(
    kernels: NativeKernels, table: RotaryTable
) -> None:
    qkv, meta = rotary_inputs(SPEC, torch.float32, extreme=False)
    k_cache, v_cache = native_write(kernels, qkv, meta, table, torch.bfloat16)
    expected_k, expected_v = native_write(kernels, qkv, meta, table, torch.float32)
    written = meta.write_blocks.unique()
    assert torch.equal(
        k_cache[written].view(torch.int16), expected_k[written].to(torch.bfloat16).view(torch.int16)
    )
    assert torch.equal(
        v_cache[written].view(torch.int16), expected_v[written].to(torch.bfloat16).view(torch.int16)
    )


def test_bytes_per_token_and_option_values() -> None:
    """q8_0: per 32 values 32 int8 + a 4-byte scale, for keys and values (SmolLM2: 3 KV heads x 64)."""
    assert cache_bytes_per_token(3, 64, Q8_DTYPE) == 2 * 3 * (64 + 8) == 432
    assert cache_bytes_per_token(3, 64, torch.bfloat16) == 768
    assert cache_dtype("auto", torch.float32) == torch.float32
    assert (
        cache_dtype("bf16", torch.float32) == torch.bfloat16
        and cache_dtype("q8_0", torch.bfloat16) == Q8_DTYPE
    )
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        cache_dtype("q4_0", torch.float32)
