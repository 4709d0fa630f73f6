"""The KV pool's memory: sized by a cap (`kv_cache_memory`), resident only where blocks are written."""

from __future__ import annotations

import pytest
import torch

from deterministic_inference.config import EngineConfig, parse_bytes
from deterministic_inference.engine.kv_memory import kv_block_bytes, lazy_kv_caches
from deterministic_inference.engine.setup import choose_num_kv_blocks
from deterministic_inference.errors import ConfigError
from deterministic_inference.model_spec import ModelSpec

SPEC = ModelSpec(
    architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
    max_position_embeddings=8192, tie_word_embeddings=True,
)  # fmt: skip
BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 2  # bf16 block of SmolLM2: 368640 bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [(4096, 4096), ("4096", 4096), ("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1.5G", 3 << 29),
     ("2GB", 2 * 10**9), ("10 kib", 10240), ("7b", 7)],
)  # fmt: skip
def test_sizes_parse_with_binary_and_decimal_units(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["banana", "2 parsecs", "-1", "0", "0.1b", "", True])
def test_bad_sizes_name_the_field(text: object) -> None:
    with pytest.raises(ConfigError, match="kv_cache_memory"):
        parse_bytes(text)  # type: ignore[arg-type]


def test_cap_sets_the_block_count() -> None:
    assert kv_block_bytes(SPEC, 16, torch.bfloat16) == BLOCK_BYTES
    config = EngineConfig(kv_cache_memory=100 * BLOCK_BYTES + 5)
    assert choose_num_kv_blocks(config, SPEC, 8192, "bfloat16") == 100
    assert choose_num_kv_blocks(config, SPEC, 8192, "float32") == 50
    default = choose_num_kv_blocks(EngineConfig(), SPEC, 8192, "bfloat16")
    assert default == (2 << 30) // BLOCK_BYTES
    assert choose_num_kv_blocks(EngineConfig(num_kv_blocks=7), SPEC, 8192, "bfloat16") == 7


def test_a_cap_below_one_block_or_both_sizes_is_refused() -> None:
    with pytest.raises(ConfigError, match="kv_cache_memory: 1024 bytes hold no KV block"):
        choose_num_kv_blocks(EngineConfig(kv_cache_memory=1024), SPEC, 8192, "bfloat16")
    with pytest.raises(ConfigError, match="set only one"):
        EngineConfig(num_kv_blocks=8, kv_cache_memory=1 << 20)


def resident_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * 4096


def test_pool_pages_become_resident_only_when_written() -> None:
    """A 1.4 GiB pool costs (almost) nothing until written; writing the first blocks of every layer
    costs about those blocks. The caches start as zeros and layers do not overlap."""
    before = resident_bytes()
    caches = lazy_kv_caches(30, 4096, 16, 3, 64, torch.bfloat16)  # 30 x 2 x 24 MiB
    allocated = resident_bytes() - before
    assert allocated < 8 << 20, allocated
    for keys, values in caches:
        keys[:4] = 1.0
        values[:4] = 2.0
    written = resident_bytes() - before
    assert written < 4 * BLOCK_BYTES + (16 << 20), written
    assert caches[0][0].shape == (4096, 3, 64, 16) and caches[0][1].shape == (4096, 3, 16, 64)
    assert all(float(k[4:].abs().max()) == 0.0 and float(v[4:].abs().max()) == 0.0 for k, v in caches)
    assert all(bool((k[:4] == 1).all()) and bool((v[:4] == 2).all()) for k, v in caches)
