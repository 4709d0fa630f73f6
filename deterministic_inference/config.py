"""Frozen, validated engine configuration.

`EngineConfig` holds every setting of the engine. Settings that can change an output's bits (dtype, the
batch-invariant switch, tile and block sizes) are the *numerics*; `numerics_digest()` hashes them and goes
into the determinism fingerprint. Scheduler limits and thread counts are deliberately NOT numerics: the
contract says outputs must not depend on them, and the tests prove it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from deterministic_inference.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class EngineConfig:
    """All engine settings; construct with keywords, validated on creation."""

    model: str | None = None  # GGUF file or HF directory; None = the embedded default model
    dtype: str = "auto"  # "auto" (bf16 on CPUs with native bf16, else fp32), "float32", "bfloat16"
    batch_invariant: bool = True  # False = plain torch ops (benchmarks, negative controls)
    linear_tile_rows: int = 4  # GEMM row granularity T: every linear call sees a multiple of T rows
    kv_block_size: int = 16  # tokens per paged KV-cache block (also the prefix-cache unit)
    num_kv_blocks: int | None = None  # None = enough for max_num_seqs sequences of max_model_len / 4
    max_model_len: int | None = None  # None = the model's context length
    max_num_seqs: int = 64  # most requests in one step
    max_num_batched_tokens: int = 512  # token budget per step; longer prompts are chunked
    enable_prefix_caching: bool = True
    threads: int | None = None  # torch intra-op threads; None = leave torch's default
    seed: int = 0  # seed for requests that give none, so every request is reproducible
    selfcheck: bool = True  # probe invariance at startup before serving in invariant mode

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: {self.dtype!r} is not one of {', '.join(DTYPES)}")
        _positive("linear_tile_rows", self.linear_tile_rows)
        _positive("kv_block_size", self.kv_block_size)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        for name in ("num_kv_blocks", "max_model_len", "threads"):
            value = getattr(self, name)
            if value is not None:
                _positive(name, value)
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed: {self.seed} must be in [0, 2**63)")

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def numerics(self, resolved_dtype: str) -> dict[str, Any]:
        """The settings that determine output bits, with the dtype resolved for this machine, and the
        revision of the op formulations (bumped when a code change can change bits)."""
        from deterministic_inference.ops import OPS_REVISION
        from deterministic_inference.ops.native import source_digest

        return {
            "ops_revision": OPS_REVISION,
            "kernel_sources": source_digest(),  # the C kernels: attention, row-wise ops, bf16 GEMM
            "dtype": resolved_dtype,
            "batch_invariant": self.batch_invariant,
            "linear_tile_rows": self.linear_tile_rows,
            "kv_block_size": self.kv_block_size,
        }

    def numerics_digest(self, resolved_dtype: str) -> str:
        """sha256 of the canonical JSON of `numerics()`."""
        text = json.dumps(self.numerics(resolved_dtype), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name}: {value!r} must be a positive integer")
