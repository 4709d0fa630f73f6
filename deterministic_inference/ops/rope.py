"""Rotary position embedding by table lookup (rotate-half / NeoX layout, as HF Llama and Qwen)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from deterministic_inference.model_spec import RopeScaling
from deterministic_inference.ops import portable
from deterministic_inference.ops.rope_scaling import scaled_frequencies

INITIAL_POSITIONS = 4096  # rows of a portable table before its first growth (RotaryTable.cover)

if TYPE_CHECKING:
    from deterministic_inference.ops.native import NativeKernels


def inverse_frequencies(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None,
    kernels: NativeKernels | None = None,
    max_positions: int = 0,
) -> tuple[torch.Tensor, float]:
    """([head_dim // 2] fp32 inverse frequencies, attention factor multiplying cos / sin) of `scaling`
    (ops/rope_scaling.py; None: plain RoPE, factor 1). `max_positions` is the model's context (LongRoPE
    chooses its factor set by it).

    With `kernels` the powers theta^e and the scaling's logarithms come from the portable kernels (torch's
    pow and libm's log dispatch on the ISA); the rest is elementwise +, -, *, / and comparisons, which
    round the same in every torch kernel."""
    if kernels is not None:
        powers = portable.rope_powers(kernels, theta, head_dim)  # [D/2]

        def log(value: float) -> float:
            return portable.natural_log(kernels, value)

        return scaled_frequencies(powers, theta, scaling, max_positions, log)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return scaled_frequencies(theta**exponents, theta, scaling, max_positions, math.log)


class RotaryTable:
    """cos/sin for every position up to `max_positions`, in fp32.

    Why invariant: a token's rotation is read from the table by its absolute position, so it cannot
    depend on the batch, the chunk it arrives in, or whether it is computed in prefill or decode. With
    `kernels` (invariant mode) the tables come from the portable kernels (csrc/rotary_tables.c: our own
    pow, sin and cos), so they are also the same on every CPU; without, torch's cos / sin (ISA-dispatched).

    Memory: the portable tables hold the first INITIAL_POSITIONS positions and `cover` grows them
    (doubling) when a step reaches further: a 128k-context model's full tables are 64 MiB at head_dim 64,
    resident from start-up though most requests are short. Each entry is a function of its (position,
    frequency) alone, so a grown table's rows are the old rows bit for bit. torch's tables are computed
    whole (its vectorised and scalar cos / sin may differ in the last bit, and which elements take which
    path depends on the table's size).

    Scaling (`RopeScaling`: linear, llama3, YaRN, LongRoPE) changes only the inverse frequencies and the
    factor both tables are multiplied by (ops/rope_scaling.py), each fixed when the table is built.
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        max_positions: int,
        scaling: RopeScaling | None,
        kernels: NativeKernels | None = None,
    ) -> None:
        # [D/2]; the attention factor (YaRN, LongRoPE) multiplies every entry of cos and sin, as HF's does
        self._inv_freq, self.attention_factor = inverse_frequencies(
            head_dim, theta, scaling, kernels, max_positions
        )
        self._kernels = kernels
        self.max_positions = max_positions
        if kernels is not None:
            portable.check_rotary_range(kernels, self._inv_freq, max_positions)  # refuse now, not mid-request
            size = min(max_positions, INITIAL_POSITIONS)
            self.cos, self.sin = self._portable_tables(kernels, size)  # [P, D] fp32
        else:
            positions = torch.arange(max_positions, dtype=torch.int64).float()  # [P]
            freqs = torch.outer(positions, self._inv_freq)  # [P, D/2]
            angles = torch.cat((freqs, freqs), dim=-1)  # [P, D]
            self.cos, self.sin = self._scaled(angles.cos(), angles.sin())  # [P, D] fp32

    def _portable_tables(self, kernels: NativeKernels, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [size, D] fp32 from the portable kernels, times the attention factor."""
        return self._scaled(*portable.rotary_tables(kernels, self._inv_freq, size))

    def _scaled(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos * factor, sin * factor (one fp32 product per entry, HF's `emb.cos() * attention_scaling`);
        the tables as they are when the factor is 1."""
        if self.attention_factor == 1.0:
            return cos, sin
        return cos * self.attention_factor, sin * self.attention_factor

    def cover(self, positions: torch.Tensor) -> None:
        """Grow the tables so every position in `positions` [T] int64 has its row (up to max_positions;
        a position beyond stays out of range, which the kernels refuse). Same rows, bit for bit."""
        have = self.cos.shape[0]
        if self._kernels is None or positions.numel() == 0 or have >= self.max_positions:
            return
        needed = int(positions.max()) + 1
        if needed > have:
            size = min(self.max_positions, max(needed, 2 * have))
            self.cos, self.sin = self._portable_tables(self._kernels, size)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] (any float dtype), positions: [T] int64 -> [T, heads, D] in x's dtype.

        As HF Llama: the fp32 tables are cast to x's dtype and the rotation is computed in that dtype.
        """
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)  # [T, 1, D]
        half = x.shape[-1] // 2
        first, second = x[..., :half], x[..., half:]
        out = x * cos  # [T, heads, D]
        # HF's x * cos + cat(-second, first) * sin, without the cat: a + (-b) * s == a - b * s exactly
        out[..., :half] -= second * sin[..., :half]
        out[..., half:] += first * sin[..., half:]
        return out
