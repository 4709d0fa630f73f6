"""Portable numerics: the floating-point work that torch would dispatch on the CPU's ISA, in our kernels.

torch picks AVX-512, AVX2 or scalar kernels at run time (`ATEN_CPU_CAPABILITY`), and those round
differently for log_softmax, softmax, pow, cos, sin, reductions; oneDNN picks its GEMM by ISA too. So the
invariant path computes every rounding operation in the compiled kernels (csrc/sampling.c,
rotary_tables.c, gemm_f32.c over portable_math.h), whose bits are fixed by the source: the same on any
x86-64 CPU and for any `DETINF_KERNEL_MARCH` build. torch still moves data (views, gathers, sorts,
integer ops) and performs single IEEE operations (+, -, *, / of tensors and scalars, comparisons,
max/argmax, casts), which round the same way in every one of its kernels.

`log_softmax_rows` is THE function that turns logits into logprobs: the sampler, prompt scoring and the
ops backend (for a trainer's forward pass) all call it, so their logprob bits are equal by construction.
Its signature is stable. `DETINF_TEST_TORCH_LOG_SOFTMAX=1` (tests only) puts torch's log_softmax back in
its place: the negative control of the cross-ISA tests.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from deterministic_inference.ops.native import NativeKernels, native_kernels

# Test-only switch: torch.log_softmax (ISA-dispatched) instead of the kernel, to prove tests detect it.
TORCH_LOG_SOFTMAX_ENV = "DETINF_TEST_TORCH_LOG_SOFTMAX"
_LOG_SOFTMAX, _SOFTMAX, _CUMSUM = 0, 1, 2


def _rows(x: torch.Tensor, op: int, kernels: NativeKernels | None) -> torch.Tensor:
    """Apply row op `op` of sampling.c along the last dimension of `x` [..., V] -> fp32 [..., V]."""
    if x.dim() == 0:
        raise ValueError("row ops need at least one dimension")
    rows = x.to(torch.float32).contiguous()
    out = torch.empty_like(rows)
    cols = rows.shape[-1] if rows.numel() else 0
    if cols:
        library = (kernels or native_kernels()).library
        library.detinf_rows(rows.data_ptr(), out.data_ptr(), rows.numel() // cols, cols, op)
    return out


def log_softmax_rows(logits: torch.Tensor, kernels: NativeKernels | None = None) -> torch.Tensor:
    """Raw logprobs: log_softmax over the last dimension of fp32 logits [..., V] -> fp32 [..., V].

    Why invariant: each row is computed alone in a source-fixed order (csrc/sampling.c), so its bits
    depend on that row only, not on the batch, the thread count, the CPU's ISA or the kernels' -march.
    `kernels` defaults to this process's build."""
    if os.environ.get(TORCH_LOG_SOFTMAX_ENV) == "1":
        return torch.log_softmax(logits.to(torch.float32), dim=-1)
    return _rows(logits, _LOG_SOFTMAX, kernels)


def greedy_rows(logits: torch.Tensor) -> tuple[list[int], list[float], list[bool]] | None:
    """Plain greedy rows of fp32 logits [R, V] in one kernel pass: (each row's lowest-id argmax, that
    token's raw logprob, whether the row is NaN-free; a row holding a NaN gets no token or logprob), or
    None under `DETINF_TEST_TORCH_LOG_SOFTMAX=1`, whose logprobs only `log_softmax_rows` computes.

    Why invariant: each row alone, by one thread, with `log_softmax_rows`'s own maximum, sum and log
    (csrc/sampling.c), so the logprob is bitwise that function's value at the token, and the token is
    the first index equal to the row's maximum, whatever the batch."""
    if os.environ.get(TORCH_LOG_SOFTMAX_ENV) == "1":
        return None
    rows = logits.to(torch.float32).contiguous()
    count, vocab = rows.shape
    tokens = torch.empty(count, dtype=torch.int64)
    values = torch.empty(count, dtype=torch.float32)
    usable = torch.zeros(count, dtype=torch.uint8)
    if count and vocab:
        native_kernels().library.detinf_greedy_rows(
            rows.data_ptr(), count, vocab, tokens.data_ptr(), values.data_ptr(), usable.data_ptr()
        )
    return tokens.tolist(), values.tolist(), [bool(flag) for flag in usable.tolist()]


def softmax_rows(values: torch.Tensor) -> torch.Tensor:
    """softmax over the last dimension [..., V] -> fp32 (row-alone, source-fixed order as above)."""
    return _rows(values, _SOFTMAX, None)


def cumsum_rows(values: torch.Tensor) -> torch.Tensor:
    """Cumulative sums along the last dimension [..., V] -> fp32: double accumulation in ascending
    order, each prefix rounded to fp32 (row-alone, so a prefix's sums never depend on what follows)."""
    return _rows(values, _CUMSUM, None)


def inverse_frequencies(kernels: NativeKernels, theta: float, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] fp32: 1 / theta^(2j / head_dim) in the kernels' portable pow (see rotary_tables.c)."""
    out = torch.empty(head_dim // 2, dtype=torch.float32)
    kernels.library.detinf_inverse_frequencies(float(theta), head_dim, out.data_ptr())
    return out


def rope_powers(kernels: NativeKernels, theta: float, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] fp32 theta^(2j / head_dim), computed as rotary_tables.c computes the powers it
    inverts: fp32 exponent 2j / D, exp(exponent * ln theta) in the portable double exp and log, rounded to
    fp32. So 1 / these (one fp32 division) are `inverse_frequencies`, bit for bit; the rope scaling types
    that need the powers themselves (YaRN, LongRoPE: 1 / (factor * power)) start from them."""
    library = kernels.library
    log_theta = float(library.detinf_test_log(float(theta)))
    dim = np.float32(head_dim)
    exponents = [float(np.float32(2 * j) / dim) for j in range(head_dim // 2)]
    powers = [np.float32(library.detinf_test_exp(exponent * log_theta)) for exponent in exponents]
    return torch.from_numpy(np.array(powers, dtype=np.float32))


def natural_log(kernels: NativeKernels, value: float) -> float:
    """ln(value) in double by the kernels' portable log (portable_math.h: bits fixed by our source; libm's
    log has ISA-dispatched variants): the rope scaling parameters' logarithms."""
    return float(kernels.library.detinf_test_log(float(value)))


_RANGE_MESSAGE = "rotary tables: angles of {positions} positions exceed the portable reduction's range (2^20)"


def check_rotary_range(kernels: NativeKernels, inv_freq: torch.Tensor, positions: int) -> None:
    """ValueError when the angles of `positions` positions exceed the portable reduction's range: the
    tables' own guard (csrc/rotary_tables.c), run before any table of that size is computed."""
    inv = inv_freq.to(torch.float32).contiguous()
    if kernels.library.detinf_rotary_out_of_range(inv.data_ptr(), positions, 2 * inv.shape[0]):
        raise ValueError(_RANGE_MESSAGE.format(positions=positions))


def rotary_tables(
    kernels: NativeKernels, inv_freq: torch.Tensor, positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """inv_freq [D/2] fp32 -> (cos, sin) [positions, D] fp32 of the angles fp32(p) * inv_freq[j]."""
    inv = inv_freq.to(torch.float32).contiguous()
    dim = 2 * inv.shape[0]
    cos = torch.empty((positions, dim), dtype=torch.float32)
    sin = torch.empty((positions, dim), dtype=torch.float32)
    library = kernels.library
    status = library.detinf_rotary_tables(inv.data_ptr(), positions, dim, cos.data_ptr(), sin.data_ptr())
    if status != 0:
        raise ValueError(_RANGE_MESSAGE.format(positions=positions))
    return cos, sin


def pack_f32(kernels: NativeKernels, weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] fp32 -> the fp32 GEMM's packed layout [ceil(N/16) * K * 16] (zero padded)."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        raise ValueError("pack_f32: the weight must be an fp32 [out, in] matrix")
    weight = weight.contiguous()
    n, k = weight.shape
    packed = torch.empty(-(-n // 16) * 16 * k, dtype=torch.float32)
    kernels.library.detinf_pack_f32(weight.data_ptr(), n, k, packed.data_ptr())
    return packed


def gemm_f32(
    kernels: NativeKernels,
    x: torch.Tensor,  # [M, K] fp32
    packed: torch.Tensor,  # pack_f32 of an [N, K] weight
    out_features: int,  # N
    bias: torch.Tensor | None,  # [N] fp32
) -> torch.Tensor:
    """x W^T (+ b) -> [M, N] fp32. Why invariant: each output is a chain of fused multiply-adds over its
    own row and column in ascending k (csrc/gemm_f32.c), whatever M, the thread count or the ISA."""
    x = x.to(torch.float32).contiguous()
    rows, k = x.shape if x.dim() == 2 else (0, -1)
    if x.dim() != 2 or packed.numel() != -(-out_features // 16) * 16 * k:
        raise ValueError("gemm_f32: x must be [M, K] and the packed weight must be [N, K] packed")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (out_features,)):
        raise ValueError("gemm_f32: the bias must be fp32 [N]")
    out = torch.empty((rows, out_features), dtype=torch.float32)
    if rows:
        kernels.library.detinf_gemm_f32(
            x.data_ptr(), rows, k, packed.data_ptr(), out_features,
            None if bias is None else bias.contiguous().data_ptr(), out.data_ptr(),
        )  # fmt: skip
    return out
