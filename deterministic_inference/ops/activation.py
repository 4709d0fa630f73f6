"""Gated MLP activation."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, batch_invariant: bool = True) -> torch.Tensor:
    """silu(gate) * up, elementwise. gate, up: [M, I] -> [M, I] in gate's dtype.

    Why invariant: `F.silu` has a vectorised body and a scalar tail that round differently (measured:
    ~6% of fp32 elements differ), and which elements fall in a tail depends on how the tensor is split
    across threads, i.e. on M. Here silu is written as gate / (1 + exp(-gate)) in fp32: exp's scalar and
    vector paths agree bit for bit (the self-check probes it) and neg, add, div and mul are exactly
    rounded IEEE operations, so every element is a function of its own inputs only. bf16 inputs are
    computed in fp32 and rounded once, like `F.silu` does. `batch_invariant=False` is `F.silu(gate) * up`.
    """
    if not batch_invariant:
        return F.silu(gate) * up
    gate32 = gate.float()
    denom = torch.neg(gate32).exp_().add_(1.0)  # [M, I] fp32
    act = torch.div(gate32, denom, out=denom)
    if gate.dtype == torch.float32:
        return act.mul_(up)
    return act.to(gate.dtype).mul_(up)
