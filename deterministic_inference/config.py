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
import re
from dataclasses import dataclass
from typing import Any

from deterministic_inference.engine.speculative import SpeculativeConfig
from deterministic_inference.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16")
# auto: GGUF weights as stored (quantized blocks stay quantized), HF safetensors in `dtype`;
# none: every weight dequantised to `dtype`; q8_0: float weights quantized to Q8_0 at load
QUANTIZATIONS = ("auto", "none", "q8_0")
# the KV cache's format (ops/kv_format.py): auto = the model dtype; q8_0 = 32 int8 + an fp32 scale per 32
KV_CACHE_DTYPES = ("auto", "bf16", "q8_0")
# the arithmetic of the bf16 GEMM: portable (bits fixed by our source, the same on every x86-64 CPU) or
# native (AMX-BF16 tiles: bits fixed per CPU class only, the ISA then in the fingerprint)
NUMERICS_MODES = ("portable", "native")
# the resolved cache format's name in the numerics, by option value (auto: the model dtype's name)
_KV_CACHE_NAMES = {"bf16": "bfloat16", "q8_0": "q8_0"}


@dataclass(frozen=True)
class EngineConfig:
    """All engine settings; construct with keywords, validated on creation."""

    model: str | None = None  # GGUF file or HF directory; None = the embedded default model
    dtype: str = "auto"  # "auto" (invariant: bf16 on every CPU; plain torch: bf16 where native), ...
    quantization: str = "auto"  # weight formats: one of QUANTIZATIONS
    batch_invariant: bool = True  # False = plain torch ops (benchmarks, negative controls)
    linear_tile_rows: int = 4  # sets the self-check's probe batch sizes (T-1, T+1, 2T+3); in manifests
    kv_block_size: int = 16  # tokens per paged KV-cache block (also the prefix-cache unit)
    kv_cache_dtype: str = "auto"  # the KV cache's format: one of KV_CACHE_DTYPES (numerics)
    numerics_mode: str = "portable"  # --numerics: one of NUMERICS_MODES (numerics)
    num_kv_blocks: int | None = None  # KV pool blocks; None = as many as fit kv_cache_memory
    kv_cache_memory: int | None = None  # KV pool cap in bytes; None = 2 GiB (at least one full context)
    max_model_len: int | None = None  # None = the model's context length
    max_num_seqs: int = 64  # most requests in one step
    max_num_batched_tokens: int = 512  # token budget per step; longer prompts are chunked
    enable_prefix_caching: bool = True
    # all-windowed models: release KV blocks behind every layer's sliding window (engine/kv_cache.py).
    # Not numerics: memory only, never a bit (False: tests' negative controls)
    free_kv_outside_window: bool = True
    threads: int | None = None  # torch intra-op threads; None = leave torch's default
    seed: int = 0  # seed for requests that give none, so every request is reproducible
    selfcheck: bool = True  # probe invariance at startup before serving in invariant mode
    # speculative decoding (engine/speculative.py); None = off. Not numerics: it never changes a bit
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(
                f"quantization: {self.quantization!r} is not one of {', '.join(QUANTIZATIONS)}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"--kv-cache-dtype: {self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}"
            )
        if self.numerics_mode not in NUMERICS_MODES:
            raise ConfigError(
                f"--numerics: {self.numerics_mode!r} is not one of {', '.join(NUMERICS_MODES)}"
            )
        if self.numerics_mode == "native" and not self.batch_invariant:
            raise ConfigError(
                "--numerics native runs the invariant kernels' AMX-BF16 GEMM: drop --no-batch-invariant"
            )
        _positive("linear_tile_rows", self.linear_tile_rows)
        _positive("kv_block_size", self.kv_block_size)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        for name in ("num_kv_blocks", "kv_cache_memory", "max_model_len", "threads"):
            value = getattr(self, name)
            if value is not None:
                _positive(name, value)
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ConfigError(
                "num_kv_blocks and kv_cache_memory both size the KV pool; set only one of them"
            )
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed: {self.seed} must be in [0, 2**63)")
        speculative = self.speculative_config
        if isinstance(speculative, (dict, str)):  # JSON text or its dict (Ray Serve args)
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_json(speculative))
        elif speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise ConfigError("speculative_config: must be a JSON object such as {\"method\": \"ngram\"}")

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def numerics(
        self,
        resolved_dtype: str,
        weight_formats: dict[str, str] | None = None,
        model_ops: tuple[str, ...] = (),
    ) -> dict[str, Any]:
        """The settings that determine output bits, with the dtype resolved for this machine, and the
        revision of the op formulations (bumped when a code change can change bits).

        `weight_formats` (tensor name -> the format the model computes it in, from the built model)
        enters as a map tensor class -> formats (layer index dropped, e.g. "mlp.down_proj.weight" ->
        "q4_k+q6_k") plus a digest of the whole per-tensor map, so a file whose formats differ per layer
        cannot share a fingerprint with another mix. `model_ops` (`DecoderModel.model_ops`: the ops beyond
        the Llama block's, e.g. sliding-window attention) enter by name when there are any. The KV cache's
        format enters as `kv_cache_dtype` only when it differs from the model dtype (auto, and bf16 under
        a bf16 model, store the same bits and keep the fingerprint they always had); `numerics_mode`
        only when native (the default keeps the fingerprint it always had)."""
        from deterministic_inference.ops import OPS_REVISION
        from deterministic_inference.ops.native_build import source_digest

        numerics: dict[str, Any] = {
            "ops_revision": OPS_REVISION,
            "kernel_sources": source_digest(),  # the C kernels: attention, row-wise ops, GEMMs
            "dtype": resolved_dtype,
            "quantization": self.quantization,
            "batch_invariant": self.batch_invariant,
            "linear_tile_rows": self.linear_tile_rows,
            "kv_block_size": self.kv_block_size,
        }
        if weight_formats is not None:
            numerics["weight_formats"] = format_classes(weight_formats)
            numerics["weight_formats_digest"] = _sha256_json(weight_formats)
        if model_ops:
            numerics["model_ops"] = list(model_ops)
        kv_cache = _KV_CACHE_NAMES.get(self.kv_cache_dtype, resolved_dtype)
        if kv_cache != resolved_dtype:
            numerics["kv_cache_dtype"] = kv_cache
        if self.numerics_mode != "portable":
            numerics["numerics_mode"] = self.numerics_mode
        return numerics

    def numerics_digest(self, resolved_dtype: str, weight_formats: dict[str, str] | None = None) -> str:
        """sha256 of the canonical JSON of `numerics()`."""
        return _sha256_json(self.numerics(resolved_dtype, weight_formats))


def format_classes(weight_formats: dict[str, str]) -> dict[str, str]:
    """tensor name -> format  =>  tensor class (name without "model.layers.N." and an expert's index:
    "mlp.experts.down_proj.weight") -> "+"-joined sorted formats of that class."""
    classes: dict[str, set[str]] = {}
    for name, fmt in weight_formats.items():
        tensor_class = re.sub(r"\.experts\.\d+\.", ".experts.", re.sub(r"^model\.layers\.\d+\.", "", name))
        classes.setdefault(tensor_class, set()).add(fmt)
    return {name: "+".join(sorted(formats)) for name, formats in sorted(classes.items())}


def _sha256_json(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name}: {value!r} must be a positive integer")


_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int, field: str = "kv_cache_memory") -> int:
    """A byte count from an int or a string like "2GiB", "512MiB", "1.5G" (K/M/G/T alone = binary,
    KB/MB/GB/TB = decimal). ConfigError naming `field` when it is not a positive size."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _SIZE.match(str(text))
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            raise ConfigError(
                f"{field}: {text!r} is not a size; write bytes or a number with a unit, e.g. 2GiB or 512MiB"
            )
        value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise ConfigError(f"{field}: {text!r} must be a positive number of bytes")
    return value
