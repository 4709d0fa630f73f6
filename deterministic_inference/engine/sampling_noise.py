"""Counter-based sampling noise: the Gumbel noise of (seed, output position, token id) and the Gumbel-max
pick that uses it (engine/sampler.py's step 4, and the batched seeded path's).

Why every bit is fixed: the noise is an integer hash of (seed, position, token id) computed with int64
torch ops (or the same arithmetic on Python ints: every product stays below 2**49, so nothing
overflows), mapped to a uniform in (0, 1) and turned into -log(-log(u)) with a logarithm written in
exact-rounded +, -, *, / (`log64`). No generator, no global RNG and no libm call whose vectorized and
scalar paths could round differently: an element depends only on its (seed, position, token id), never
on the batch, the row's position, the thread count or the CPU's ISA.
"""

from __future__ import annotations

import math
from typing import TypeVar

import torch

_M32 = 0xFFFFFFFF
_LN2 = math.log(2.0)
_SQRT2 = math.sqrt(2.0)
# Gumbel noise lies in [-log(-log(2**-33)), -log(-log(1 - 2**-33))] = [-3.13, 22.87]: a token whose value
# is more than this span below the best value can never win, so its noise need not be computed.
_NOISE_SPAN = 27.0

_Int = TypeVar("_Int", int, torch.Tensor)  # the hash runs on Python ints (one row) or int64 tensors


def _mul32(x: _Int, c: int) -> _Int:
    """(x * c) mod 2**32 for int64 x in [0, 2**32): c is split in 16-bit halves so every product stays
    below 2**49 (never overflows int64)."""
    low, high = c & 0xFFFF, c >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _M32


def _mix32(x: _Int) -> _Int:
    """A bijective 32-bit avalanche mix (xor-shift / multiply rounds) on int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seeds: _Int, positions: _Int) -> tuple[_Int, _Int]:
    """Two 32-bit keys per row from (seed, output position): int64 tensors [R] or Python ints (same
    integer arithmetic, so the same keys)."""
    key = _mix32((seeds & _M32) ^ 0x243F6A88)
    key = _mix32(key ^ ((seeds >> 32) & _M32))
    key = _mix32(key ^ (positions & _M32))
    return key, _mix32(key ^ 0x85A308D3)


def log64(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive normal float64 values using only exact-rounded +, -, *, / (so the result
    of an element never depends on where it sits in a tensor): x = m * 2**e with m in [sqrt(1/2),
    sqrt(2)), log m = 2 atanh(s), s = (m - 1) / (m + 1), |s| < 0.172, series to s**23."""
    bits = x.view(torch.int64)
    exponent = (bits >> 52) - 1023
    mantissa = ((bits & ((1 << 52) - 1)) | (1023 << 52)).view(torch.float64)  # in [1, 2)
    big = mantissa > _SQRT2
    mantissa = torch.where(big, mantissa * 0.5, mantissa)
    exponent = exponent + big.to(torch.int64)
    s = (mantissa - 1.0) / (mantissa + 1.0)
    s2 = s * s
    series = torch.full_like(s, 1.0 / 23.0)
    for odd in range(21, 0, -2):
        series = series * s2 + 1.0 / odd
    return (s * series) * 2.0 + exponent.to(torch.float64) * _LN2


def token_uniforms(
    key1: torch.Tensor | int, key2: torch.Tensor | int, token_ids: torch.Tensor
) -> torch.Tensor:
    """Uniforms (float64) in [2**-33, 1 - 2**-33], never 0 or 1, from two hash rounds over the token id;
    keys broadcast against token_ids."""
    h = _mix32(_mul32(token_ids & _M32, 0x9E3779B1) ^ key1)
    h = _mix32(h ^ key2)
    return (h.to(torch.float64) + 0.5) * 2.0**-32


def gumbel(uniform: torch.Tensor) -> torch.Tensor:
    """Exact Gumbel noise -log(-log(u)) as float32, through `log64` (position-independent bits)."""
    return (-log64(-log64(uniform))).to(torch.float32)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel noise [R, V] float32 for rows (seed, output position); element (r, t) depends ONLY on
    (seeds[r], positions[r], t): integer hashing and elementwise exact-rounded arithmetic, so it is
    invariant to batch composition, row position and thread count by construction."""
    key1, key2 = row_keys(seeds.to(torch.int64), positions.to(torch.int64))
    token_ids = torch.arange(vocab_size, dtype=torch.int64)
    return gumbel(token_uniforms(key1[:, None], key2[:, None], token_ids[None, :]))


def gumbel_at(seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel noise [R, S] float32 of token_ids [R, S] for rows (seeds [R], positions [R]): element (r, j)
    is `gumbel_noise(...)[r, token_ids[r, j]]`, the same elementwise integer / exact-rounded steps."""
    key1, key2 = row_keys(seeds.to(torch.int64), positions.to(torch.int64))
    return gumbel(token_uniforms(key1[:, None], key2[:, None], token_ids))


def gumbel_argmax(ids: torch.Tensor, values: torch.Tensor, seed: int, position: int) -> int:
    """argmax over `ids` of values + gumbel(seed, position, id), ties -> lowest id; exactly the result of
    adding `gumbel_noise` to every value, but the exact noise is only computed where it can matter:

    1. tokens more than the noise span (+ rounding slack) below the best value cannot win: dropped;
    2. an approximate score value + (-log(-log u)) in float64 with torch.log (error < 1e-12, its bits
       irrelevant) bounds every exact float32 score within `slack`, so only tokens whose approximate
       score is within 2 * slack of the best can be (or tie with) the exact winner;
    3. those few get the exact noise, and the exact float32 scores decide.
    """
    best = float(values.max())
    if math.isfinite(best):
        keep = values >= best - (_NOISE_SPAN + abs(best) * 2.0**-20)
        ids, values = ids[keep], values[keep]
    key1, key2 = row_keys(seed, position)
    uniform = token_uniforms(key1, key2, ids)
    approx = values.to(torch.float64) - torch.log(-torch.log(uniform))
    top = float(approx.max())
    if math.isfinite(top):
        near = approx >= top - 2.0 * (1e-4 + abs(top) * 2.0**-20)
    else:
        near = approx == top
    ids, values, uniform = ids[near], values[near], uniform[near]
    scores = values + gumbel(uniform)
    return int(ids[scores == scores.max()].min())
