"""Logprobs of logits rows: the ONE function every consumer of raw logprobs calls.

The engine's sampler (per-row path, batched greedy and seeded paths, prompt logprobs) and the RL policy
(`deterministic_inference/rl`) all compute logprobs through `log_softmax_rows`, so a trainer's logprob of
a token is, bit for bit, the logprob the sampler reported for it whenever the two logits rows are equal
(which the row-invariant kernels guarantee). Replace the body here, never beside it: a second copy of
this computation anywhere else could round differently.
"""

from __future__ import annotations

import torch

from deterministic_inference.ops import portable


def log_softmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] (any float dtype) -> log_softmax of each row [R, V] fp32 (a new tensor).

    Why invariant: the body is the portable C kernel (`ops.portable.log_softmax_rows`): each row is
    computed alone, whole, in a source-fixed order with our own exp/log, so row r's bits are a function of
    logits[r] alone: the same with 1 row or 64, at any position, with 1 or 2 threads, on any x86-64 CPU
    (tests/engine/test_sampler_batched.py and tests/ops/test_portable*.py check this bit for bit)."""
    if logits.dim() != 2:
        raise ValueError(f"log_softmax_rows: expected logits [rows, vocab], got shape {tuple(logits.shape)}")
    return portable.log_softmax_rows(logits.to(torch.float32).contiguous())
