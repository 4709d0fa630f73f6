"""A numpy re-enactment of the quantized GEMM's documented arithmetic (ops/csrc/quant.h), for the tests.

It shares no code with the kernels: the weights' integers and scales are decoded by the `gguf` package
(dequantizing copies of the blocks whose scale fields are set to 1 and 0), activations are quantized
with numpy fp32 operations, integer sums run in int64, and each fmaf is an exactly rounded fp32 fused
multiply-add built from float64 (`fma32`).
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch

from deterministic_inference.ops.quant import QuantizedWeight

F32, F64 = np.float32, np.float64
ONE_F16 = np.array([0x00, 0x3C], dtype=np.uint8)  # fp16 1.0, little endian


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """a * b + c rounded once to fp32 (fp32 inputs; no overflow or underflow in the tests' ranges)."""
    a64, b64, c64 = (np.asarray(v, dtype=F32).astype(F64) for v in (a, b, c))
    product = a64 * b64  # exact: 24 + 24 bits
    total = product + c64
    back = total - product
    error = (product - (total - back)) + (c64 - back)  # product + c == total + error exactly
    rounded = total.astype(F32)
    low = np.where(rounded.astype(F64) <= total, rounded, np.nextafter(rounded, F32(-np.inf)))
    high = np.nextafter(low, F32(np.inf))
    midpoint = (low.astype(F64) + high.astype(F64)) * 0.5 == total  # only here can `error` decide
    fixed = np.where(error > 0, high, np.where(error < 0, low, rounded))
    return np.where(midpoint, fixed, rounded).astype(F32)


@dataclass(frozen=True)
class DecodedWeight:
    """ints [N, K] int64 (the format's integers, offsets applied); per block: d, m [N, blocks] fp32;
    K formats: sub-block scales sc [N, subs] and mins mn [N, supers * 8] int64."""

    ints: np.ndarray
    d: np.ndarray
    m: np.ndarray | None
    sc: np.ndarray | None
    mn: np.ndarray | None


def _dequant(blocks: np.ndarray, name: str) -> np.ndarray:
    return gguf.quants.dequantize(blocks.reshape(blocks.shape[0], -1), gguf.GGMLQuantizationType[name])


def decode(weight: QuantizedWeight) -> DecodedWeight:
    """The integers and scales of every block, read through gguf's dequantizer."""
    name, (n, k) = weight.fmt.name, weight.shape
    blocks = weight.data.numpy().reshape(n, k // weight.fmt.block_values, weight.fmt.block_bytes).copy()
    half = lambda at: blocks[:, :, at : at + 2].copy().view(np.float16)[..., 0].astype(F32)  # noqa: E731
    if weight.fmt.block_values == 32:
        unit = blocks.copy()
        unit[:, :, 0:2] = ONE_F16
        if name in ("Q4_1", "Q5_1"):
            unit[:, :, 2:4] = 0
        ints = _dequant(unit, name).astype(np.int64)
        return DecodedWeight(ints, half(0), half(2) if name in ("Q4_1", "Q5_1") else None, None, None)
    if name == "Q6_K":
        unit = blocks.copy()
        unit[:, :, 192:208], unit[:, :, 208:210] = 1, ONE_F16
        ones = blocks.copy()
        ones[:, :, 0:128], ones[:, :, 128:192], ones[:, :, 208:210] = 0x11, 0xAA, ONE_F16  # q = 33
        scales = _dequant(ones, name).reshape(n, -1, 16)[:, :, 0]  # value 1 times sc_j
        return DecodedWeight(
            _dequant(unit, name).astype(np.int64), half(208), None, scales.astype(np.int64), None
        )
    qs = 16 if name == "Q4_K" else 48
    unit = blocks.copy()
    unit[:, :, 0:2], unit[:, :, 2:4] = ONE_F16, 0
    unit[:, :, 4:16] = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], dtype=np.uint8)  # sc 1, m 0
    scale_only = blocks.copy()
    scale_only[:, :, 0:2], scale_only[:, :, 2:4], scale_only[:, :, qs:] = ONE_F16, 0, 0x11  # q = 1
    if name == "Q5_K":
        scale_only[:, :, 16:48] = 0
    mins_only = blocks.copy()
    mins_only[:, :, 0:2], mins_only[:, :, 2:4] = 0, ONE_F16  # 0 * q - 1 * m
    sc = _dequant(scale_only, name).reshape(n, -1, 32)[:, :, 0]
    mn = -_dequant(mins_only, name).reshape(n, -1, 32)[:, :, 0]
    return DecodedWeight(
        _dequant(unit, name).astype(np.int64), half(0), half(2), sc.astype(np.int64), mn.astype(np.int64)
    )


def quantize_rows(x: np.ndarray, block: int, shared_amax: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Activation quantization of quant.h in numpy fp32: -> q [M, K] int64, d [M, K / block] fp32.
    `shared_amax`: the largest |x| over all rows (the broken variant a negative control needs)."""
    m, k = x.shape
    blocks = x.astype(F32).reshape(m, k // block, block)
    amax = np.abs(blocks).max(axis=2)  # [M, B]
    if shared_amax:
        amax = np.broadcast_to(amax.max(axis=0, keepdims=True), amax.shape)
    tiny = amax < F32(2.0**-120)
    safe = np.where(tiny, F32(1), amax).astype(F32)
    scale = (F32(127) / safe).astype(F32)
    q = np.rint((blocks * scale[:, :, None]).astype(F32)).clip(-127, 127)
    q = np.where(tiny[:, :, None], 0, q).astype(np.int64).reshape(m, k)
    d = np.where(tiny, F32(0), (safe / F32(127)).astype(F32)).astype(F32)
    return q, d


def documented_output(
    x: torch.Tensor,  # [M, K] fp32 or bf16
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,  # [N] fp32
    descending: bool = False,  # negative control: blocks in the other order
    shared_amax: bool = False,  # negative control: one activation scale per block column for all rows
) -> torch.Tensor:
    """The fp32 output quant.h defines, element by element. -> [M, N] fp32"""
    w, name = decode(weight), weight.fmt.name
    xs = x.float().numpy()
    k_format = weight.fmt.block_values == 256
    q, dx = quantize_rows(xs, 256 if k_format else 32, shared_amax)
    m, n = xs.shape[0], weight.shape[0]
    acc = np.zeros((m, n), dtype=F32)
    blocks = range(dx.shape[1])
    for b in reversed(blocks) if descending else blocks:
        step = _super_block_step if k_format else _block_step
        acc = step(name, w, q, dx, b, acc)
    if bias is not None:
        acc = (acc + bias.numpy().astype(F32)[None, :]).astype(F32)
    return torch.from_numpy(acc)


def _block_step(
    name: str, w: DecodedWeight, q: np.ndarray, dx: np.ndarray, b: int, acc: np.ndarray
) -> np.ndarray:
    part = slice(32 * b, 32 * b + 32)
    isum = q[:, part] @ w.ints[:, part].T  # [M, N] exact int64
    scale = (w.d[None, :, b] * dx[:, b, None]).astype(F32)
    acc = fma32(scale, isum.astype(F32), acc)
    if w.m is not None:
        sums = q[:, part].sum(axis=1)  # [M]
        acc = fma32(
            (w.m[None, :, b] * dx[:, b, None]).astype(F32),
            np.broadcast_to(sums[:, None], acc.shape).astype(F32),
            acc,
        )
    return acc


def _super_block_step(
    name: str, w: DecodedWeight, q: np.ndarray, dx: np.ndarray, s: int, acc: np.ndarray
) -> np.ndarray:
    width = 16 if name == "Q6_K" else 32
    subs = 256 // width
    isum = np.zeros(acc.shape, dtype=np.int64)
    msum = np.zeros(acc.shape, dtype=np.int64)
    assert w.sc is not None
    for j in range(subs):
        part = slice(256 * s + width * j, 256 * s + width * j + width)
        isum += (q[:, part] @ w.ints[:, part].T) * w.sc[None, :, s * subs + j]
        if w.mn is not None:
            msum += q[:, part].sum(axis=1)[:, None] * w.mn[None, :, s * subs + j]
    acc = fma32((w.d[None, :, s] * dx[:, s, None]).astype(F32), isum.astype(F32), acc)
    if w.m is not None:
        scale = -(w.m[None, :, s] * dx[:, s, None]).astype(F32)
        acc = fma32(scale, msum.astype(F32), acc)
    return acc


def float64_reference(x: torch.Tensor, weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ dequantized(W)^T in float64, the bound on |kernel - reference| per element). The bound: each
    activation is rounded to its block's grid, at most amax / 254 away (amax = the block's largest |x|),
    plus 1e-5 of sum |x||w| for the fp32 roundings (scale products, conversions and one fma per block, and
    gguf's own fp32 rounding of the dequantized weights)."""
    name = weight.fmt.name
    wd = torch.from_numpy(
        gguf.quants.dequantize(weight.data.numpy(), gguf.GGMLQuantizationType[name])
    ).double()
    xd = x.double()
    block = weight.fmt.block_values
    amax = xd.abs().view(xd.shape[0], -1, block).amax(dim=2)  # [M, B]
    step = (amax / 254).repeat_interleave(block, dim=1)  # [M, K]: the largest rounding error of each x
    bound = step @ wd.abs().T + 1e-5 * (xd.abs() @ wd.abs().T)
    return xd @ wd.T, bound
