"""Rotary frequency scaling: the inverse frequencies [D/2] fp32 and the cos / sin multiplier of each
rope_scaling type, from the powers theta^(2j/D).

The formulas are transformers' (`modeling_rope_utils`: linear, llama3, yarn, longrope), written as the
same fp32 tensor expressions, so the tables differ from HF's only where its pow, cos and sin (torch's,
ISA-dispatched) differ from ours. A GGUF file's llama3 scaling is llama.cpp's per-frequency divisors
(rope_freqs.weight), applied as inv_freq[j] / freq_factors[j].

Why the same bits on every CPU: in invariant mode the powers come from the portable kernels
(`portable.rope_powers`) and the few scalar logarithms (YaRN's correction range and attention factor,
LongRoPE's attention factor) from the kernels' portable log (`portable.natural_log`), not libm; every
other step is a single IEEE operation (+, -, *, / of fp32 tensors and scalars, comparisons, clamp),
rounded the same way by every torch kernel, or a Python double operation (+, -, *, /, sqrt, floor, ceil:
correctly rounded by IEEE).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from deterministic_inference.model_spec import ROPE_SCALING_TYPES, RopeScaling

Log = Callable[[float], float]  # natural logarithm of a positive double


def scaled_frequencies(
    powers: torch.Tensor,  # [D/2] fp32: theta^(2j/D)
    theta: float,
    scaling: RopeScaling | None,
    max_positions: int,
    log: Log,
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [D/2] fp32, attention factor that multiplies cos and sin) of `scaling`.

    `max_positions` (the model's context as configured) only chooses LongRoPE's factor set: one choice per
    model, so a position's rotation never depends on how long its sequence grows."""
    inv_freq = 1.0 / powers  # [D/2]
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling.rope_type
    if kind == "linear":
        return inv_freq / scaling.factor, 1.0
    if kind == "llama3":
        if scaling.freq_factors:
            return inv_freq / _factors(scaling.freq_factors, powers), 1.0
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(powers, theta, scaling, log)
    if kind == "longrope":
        return _longrope(powers, scaling, max_positions, log)
    raise ValueError(
        f"rope scaling type {kind!r} is not supported (supported: {', '.join(ROPE_SCALING_TYPES)})"
    )


def longrope_uses_long_factors(scaling: RopeScaling, max_positions: int) -> bool:
    """Whether a LongRoPE model with context `max_positions` rotates with its long factors.

    HF switches per forward pass on the sequence's length (> original_max_position_embeddings), so a
    prefix's logits would change once its sequence grew past it; llama.cpp chooses once by its context
    size (n_ctx). We choose as llama.cpp: by the context the model is built for, so every position's
    rotation is fixed for the model's life (and the fingerprint names the choice). Equal to HF's for
    sequences longer than original_max_position_embeddings when the context exceeds it, and for every
    sequence when it does not."""
    return max_positions > scaling.original_max_position_embeddings


def rope_variant(scaling: RopeScaling | None, max_positions: int) -> str | None:
    """The name the fingerprint's model ops give the rotary scaling (None: plain RoPE), e.g. "rope_yarn",
    "rope_llama3_freq_factors", "rope_longrope_long"."""
    if scaling is None:
        return None
    name = f"rope_{scaling.rope_type}"
    if scaling.rope_type == "llama3" and scaling.freq_factors:
        return name + "_freq_factors"
    if scaling.rope_type == "longrope":
        return name + ("_long" if longrope_uses_long_factors(scaling, max_positions) else "_short")
    return name


def _factors(values: tuple[float, ...], powers: torch.Tensor) -> torch.Tensor:
    """Per-frequency factors as an fp32 tensor [D/2] (ValueError when their count is not D/2)."""
    if len(values) != powers.shape[0]:
        raise ValueError(
            f"rope scaling has {len(values)} frequency factors, expected {powers.shape[0]} (head_dim / 2)"
        )
    return torch.tensor(values, dtype=torch.float32)


def _llama3(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth blend between."""
    old_context = scaling.original_max_position_embeddings
    low_wavelen = old_context / scaling.low_freq_factor
    high_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(powers: torch.Tensor, theta: float, scaling: RopeScaling, log: Log) -> tuple[torch.Tensor, float]:
    """YaRN: dimensions that turn fewer than beta_slow times over the original context are interpolated
    (divided by factor), those that turn more than beta_fast times kept, a linear ramp between; cos and
    sin are multiplied by the attention factor (0.1 ln(factor) + 1 unless the file gives it)."""
    dim, factor = 2 * powers.shape[0], scaling.factor
    attention = scaling.attention_factor
    if attention is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention = _mscale(factor, scaling.mscale, log) / _mscale(factor, scaling.mscale_all_dim, log)
        else:
            attention = _mscale(factor, 1.0, log)
    low, high = _correction_range(scaling, dim, theta, log)
    if low == high:
        high += 0.001  # as HF: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [D/2]
    extrapolated_share = 1 - ramp
    extrapolation = 1.0 / powers
    interpolation = 1.0 / (factor * powers)
    inv_freq = interpolation * (1 - extrapolated_share) + extrapolation * extrapolated_share
    return inv_freq, float(attention)


def _mscale(factor: float, scale: float, log: Log) -> float:
    return 1.0 if factor <= 1 else 0.1 * scale * log(factor) + 1.0


def _correction_range(scaling: RopeScaling, dim: int, theta: float, log: Log) -> tuple[float, float]:
    """The dimensions (fractional unless truncated) where YaRN's ramp starts and ends."""
    context = scaling.original_max_position_embeddings

    def dimension(rotations: float) -> float:
        return (dim * log(context / (rotations * 2 * math.pi))) / (2 * log(theta))

    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _longrope(
    powers: torch.Tensor, scaling: RopeScaling, max_positions: int, log: Log
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): inv_freq[j] = 1 / (ext[j] * theta^(2j/D)) with the short or long factors
    (`longrope_uses_long_factors`); cos and sin multiplied by sqrt(1 + ln(factor) / ln(original context))
    unless the file gives the attention factor."""
    use_long = longrope_uses_long_factors(scaling, max_positions)
    ext = _factors(scaling.long_factor if use_long else scaling.short_factor, powers)  # [D/2]
    attention = scaling.attention_factor
    if attention is None:
        if scaling.factor <= 1.0:
            attention = 1.0
        else:
            attention = math.sqrt(1 + log(scaling.factor) / log(scaling.original_max_position_embeddings))
    return 1.0 / (ext * powers), float(attention)
