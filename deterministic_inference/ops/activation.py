"""Gated MLP activation."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise. gate, up: [M, I] -> [M, I].

    Why invariant: elementwise, and with contiguous rows whose width I is a multiple of 32 every
    element goes through the same vectorised kernel whatever M is (F.silu's fp32 scalar tail differs
    from its vector body, so widths that are not multiples of 32 could change bits with M). The
    start-up self-check probes it at the model's real width.
    """
    return F.silu(gate) * up
