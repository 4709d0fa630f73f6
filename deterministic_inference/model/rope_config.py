"""Rope scaling as the files state it: an HF config's `rope_scaling` / `rope_parameters` and a GGUF
file's `{arch}.rope.scaling.*` keys and rope factor tensors, read into a `RopeScaling` (the formulas are
ops/rope_scaling.py's). Every other scaling type is refused in one line naming the supported ones.

HF (transformers' reading): `rope_type` (or legacy `type`) linear / llama3 / yarn / longrope;
original_max_position_embeddings from the top-level key first (Phi-3 keeps it there), then the rope
dict, then max_position_embeddings; YaRN's and LongRoPE's missing factor is max_position_embeddings /
original_max_position_embeddings.

GGUF (llama.cpp's converter): Llama 3.1 / 3.2 files carry their llama3 scaling only as the per-frequency
divisors `rope_freqs.weight` [head_dim / 2]; Phi-3 long-context files `rope_factors_long.weight` /
`rope_factors_short.weight` with `rope.scaling.attn_factor` and `.original_context_length`; YaRN and
linear scaling are `rope.scaling.type` with `.factor` (YaRN also `.original_context_length`,
`.yarn_beta_fast`, `.yarn_beta_slow`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from deterministic_inference.errors import ModelLoadError
from deterministic_inference.model.gguf_file import metadata_float
from deterministic_inference.model_spec import ROPE_SCALING_TYPES, RopeScaling

SUPPORTED_TEXT = f"supported: default, {', '.join(ROPE_SCALING_TYPES)}"
# GGUF rope factor tensors: read into the spec, never weights of a layer
GGUF_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def hf_rope_scaling(
    config_path: Path, config: Mapping[str, Any], rope: Mapping[str, Any], head_dim: int
) -> RopeScaling | None:
    """The scaling an HF rope dict (`rope_scaling`, `rope_parameters` or one of Gemma 3's per layer type)
    describes; None for default RoPE."""
    kind = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
    if kind in (None, "default"):
        return None
    if kind not in ROPE_SCALING_TYPES:
        raise ModelLoadError(f"{config_path}: rope scaling type {kind!r} is not supported ({SUPPORTED_TEXT})")
    max_positions = int(config.get("max_position_embeddings") or 0)
    original = config.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
    try:
        original = int(original or max_positions)
        scaling = _hf_scaling(kind, rope, original, max_positions)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise ModelLoadError(f"{config_path}: {kind} rope scaling is incomplete or invalid: {exc!r}") from exc
    _check_factor_counts(config_path, scaling, head_dim)
    return scaling


def scaled_context(max_positions: int, scaling: RopeScaling | None) -> int:
    """The context a model may be served at: a YaRN file's max_position_embeddings (context_length) is
    its pre-training context (Qwen2.5: 32768, with factor 4 to reach 131072), so YaRN extends it to
    original_max_position_embeddings * factor, as vLLM derives it; every other type's files already state
    their extended context (Llama 3.1, Phi-3 128k, Gemma 3: 131072)."""
    if scaling is None or scaling.rope_type != "yarn":
        return max_positions
    return max(max_positions, int(scaling.original_max_position_embeddings * scaling.factor))


def _hf_scaling(kind: str, rope: Mapping[str, Any], original: int, max_positions: int) -> RopeScaling:
    if kind == "linear":
        return RopeScaling("linear", factor=float(rope["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            factor=float(rope["factor"]),
            original_max_position_embeddings=original,
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
        )
    factor = float(rope.get("factor") or max_positions / original)
    attention = rope.get("attention_factor")
    common: dict[str, Any] = dict(
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=None if attention is None else float(attention),
    )
    if kind == "yarn":
        return RopeScaling(
            "yarn",
            beta_fast=float(rope.get("beta_fast") or 32.0),
            beta_slow=float(rope.get("beta_slow") or 1.0),
            truncate=bool(rope.get("truncate", True)),
            mscale=float(rope.get("mscale") or 0.0),
            mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
            **common,
        )
    return RopeScaling(
        "longrope",
        short_factor=tuple(float(v) for v in rope["short_factor"]),
        long_factor=tuple(float(v) for v in rope["long_factor"]),
        **common,
    )


def gguf_rope_scaling(
    path: Path, meta: dict[str, Any], arch: str, tensors: Mapping[str, Any], head_dim: int
) -> RopeScaling | None:
    """The scaling a GGUF file states (see the module docstring); None for default RoPE."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    kind = None if kind in (None, "none") else str(kind)
    factor = metadata_float(meta, f"{arch}.rope.scaling.factor", 0.0)
    original = int(meta.get(f"{arch}.rope.scaling.original_context_length", 0))
    if "rope_freqs.weight" in tensors:
        if kind is not None:
            raise ModelLoadError(
                f"{path}: rope_freqs.weight together with {arch}.rope.scaling.type {kind!r} is not supported "
                "(rope_freqs.weight alone: Llama 3.1 style scaling)"
            )
        factors = _factor_tensor(path, tensors, "rope_freqs.weight", head_dim)
        return RopeScaling("llama3", factor=factor or 1.0, original_max_position_embeddings=original,
                           freq_factors=factors)  # fmt: skip
    if "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
        return _gguf_longrope(path, meta, arch, tensors, head_dim, original)
    if kind is None:
        return None
    if kind == "linear" and factor > 0:
        return RopeScaling("linear", factor=factor)
    if kind == "yarn" and factor > 0:
        return _gguf_yarn(path, meta, arch, factor, original)
    raise ModelLoadError(
        f"{path}: {arch}.rope.scaling.type {kind!r} (factor {factor}) is not supported "
        "(supported: none, linear and yarn with a factor > 0, rope_freqs.weight, rope_factors_long/short)"
    )


def _gguf_yarn(path: Path, meta: dict[str, Any], arch: str, factor: float, original: int) -> RopeScaling:
    """YaRN as llama.cpp reads it: its attention factor 1 + 0.1 ln(factor) (HF's default), so a file whose
    extra YaRN keys change that (log multiplier, attention or extrapolation factor) is refused."""
    key = f"{arch}.rope.scaling."
    for name, neutral in (
        ("yarn_log_multiplier", (0.0,)),
        ("yarn_attn_factor", (1.0,)),
        ("yarn_ext_factor", (-1.0, 1.0)),
    ):
        value = metadata_float(meta, key + name, neutral[0])
        if value not in neutral:
            raise ModelLoadError(
                f"{path}: {key}{name} {value} is not supported (YaRN with its default attention factor only)"
            )
    context = int(meta.get(f"{arch}.context_length", 0))
    return RopeScaling(
        "yarn",
        factor=factor,
        original_max_position_embeddings=original or int(context / factor),
        beta_fast=metadata_float(meta, key + "yarn_beta_fast", 32.0) or 32.0,
        beta_slow=metadata_float(meta, key + "yarn_beta_slow", 1.0) or 1.0,
    )


def _gguf_longrope(  # noqa: PLR0913
    path: Path, meta: dict[str, Any], arch: str, tensors: Mapping[str, Any], head_dim: int, original: int
) -> RopeScaling:
    """Phi-3 long-context rope: both factor tensors, the original context and (as llama.cpp's converter
    writes it) the attention factor; HF's factor is context_length / original_context_length."""
    if "rope_factors_long.weight" not in tensors or "rope_factors_short.weight" not in tensors:
        raise ModelLoadError(
            f"{path}: longrope needs both rope_factors_long.weight and rope_factors_short.weight"
        )
    if original <= 0:
        raise ModelLoadError(f"{path}: longrope needs {arch}.rope.scaling.original_context_length")
    context = int(meta.get(f"{arch}.context_length", original))
    key = f"{arch}.rope.scaling.attn_factor"
    attention = meta.get(key)
    return RopeScaling(
        "longrope",
        factor=context / original,
        original_max_position_embeddings=original,
        attention_factor=None if attention is None else metadata_float(meta, key, 1.0),
        short_factor=_factor_tensor(path, tensors, "rope_factors_short.weight", head_dim),
        long_factor=_factor_tensor(path, tensors, "rope_factors_long.weight", head_dim),
    )


def _factor_tensor(path: Path, tensors: Mapping[str, Any], name: str, head_dim: int) -> tuple[float, ...]:
    """A [head_dim / 2] float rope factor tensor as fp32 values (exact as Python floats)."""
    tensor = tensors[name]
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1 or tensor.shape[0] != head_dim // 2:
        shape = tuple(tensor.shape) if hasattr(tensor, "shape") else "?"
        raise ModelLoadError(
            f"{path}: tensor {name} must be a float vector of {head_dim // 2} (head_dim / 2), got {shape}"
        )
    values = tuple(float(v) for v in tensor.to(torch.float32).tolist())
    if not all(0 < v < float("inf") for v in values):
        raise ModelLoadError(f"{path}: tensor {name} holds a factor that is not finite and > 0")
    return values


def _check_factor_counts(config_path: Path, scaling: RopeScaling, head_dim: int) -> None:
    """Refuse what would make the tables meaningless: a factor <= 0 or a factor list of the wrong length."""
    values = (scaling.factor, *scaling.short_factor, *scaling.long_factor)
    if not all(value > 0 for value in values):
        raise ModelLoadError(f"{config_path}: {scaling.rope_type} rope scaling factors must be > 0")
    for name in ("short_factor", "long_factor"):
        values = getattr(scaling, name)
        if values and len(values) != head_dim // 2:
            raise ModelLoadError(
                f"{config_path}: rope scaling {name} has {len(values)} values, "
                f"expected {head_dim // 2} (head_dim / 2)"
            )
