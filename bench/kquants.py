"""Simple numpy quantizers for the K-quant block formats (Q4_K, Q5_K, Q6_K), for the benchmark model maker.

The `gguf` package quantizes the 32-value formats but only dequantizes the K-quants, so these write the
byte layouts of ggml's `block_q4_K` / `block_q5_K` / `block_q6_K` from the fields (super-block scales,
6-bit or 8-bit sub-block scales, the quants). The fitting is deliberately plain (per sub-block min/max,
no iterative search like llama.cpp's): the files are random-weight benchmark models, and what matters is
a valid layout that every reader decodes to the same values. `gguf.quants.dequantize` is the oracle in
the tests. All arithmetic is elementwise numpy on float32, so a given input always gives the same bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

QK_K = 256  # values per super-block


class AffineFields(NamedTuple):
    """Q4_K / Q5_K fields of `n` super-blocks of 8 sub-blocks of 32: value = d*sc*q - dmin*m."""

    d: np.ndarray  # [n] float16: scale of the sub-block scales
    dmin: np.ndarray  # [n] float16: scale of the sub-block mins
    sc: np.ndarray  # [n, 8] uint8 in 0..63
    m: np.ndarray  # [n, 8] uint8 in 0..63
    q: np.ndarray  # [n, 8, 32] uint8 in 0..levels


class SymmetricFields(NamedTuple):
    """Q6_K fields of `n` super-blocks of 16 sub-blocks of 16: value = d*sc*(q - 32)."""

    d: np.ndarray  # [n] float16
    sc: np.ndarray  # [n, 16] int8
    q: np.ndarray  # [n, 16, 16] uint8 in 0..63


def _safe_ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den, 0 where den == 0 (all-zero blocks)."""
    out = np.zeros(np.broadcast(num, den).shape, dtype=np.float32)
    np.divide(num, den, out=out, where=den != 0)
    return out


def affine_fields(blocks: np.ndarray, levels: int) -> AffineFields:
    """Fit Q4_K (levels=15) / Q5_K (levels=31) fields to `blocks` [n, 256] float32: per sub-block
    scale = (max - min(min, 0)) / levels and min offset = -min(min, 0), both stored as 6-bit multiples
    of fp16 super-block scales; then each value rounded to the nearest level."""
    x = blocks.astype(np.float32).reshape(-1, 8, 32)  # [n, 8, 32]
    low = np.minimum(x.min(axis=-1), np.float32(0))  # [n, 8]
    scale = (x.max(axis=-1) - low) / np.float32(levels)  # [n, 8] >= 0
    offset = -low  # [n, 8] >= 0
    d = (scale.max(axis=-1) / np.float32(63)).astype(np.float16)  # [n]
    dmin = (offset.max(axis=-1) / np.float32(63)).astype(np.float16)
    sc = np.clip(np.rint(_safe_ratio(scale, d.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_safe_ratio(offset, dmin.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc.astype(np.float32)  # [n, 8]
    shift = dmin.astype(np.float32)[:, None] * m.astype(np.float32)
    q = np.rint(_safe_ratio(x + shift[..., None], step[..., None]))
    return AffineFields(d, dmin, sc, m, np.clip(q, 0, levels).astype(np.uint8))


def symmetric_fields(blocks: np.ndarray) -> SymmetricFields:
    """Fit Q6_K fields to `blocks` [n, 256] float32: per 16-value sub-block scale = max|x| / 31 as an
    int8 multiple of an fp16 super-block scale, values rounded to q - 32 in -32..31."""
    x = blocks.astype(np.float32).reshape(-1, 16, 16)  # [n, 16, 16]
    scale = np.abs(x).max(axis=-1) / np.float32(31)  # [n, 16]
    d = (scale.max(axis=-1) / np.float32(127)).astype(np.float16)  # [n]
    sc = np.clip(np.rint(_safe_ratio(scale, d.astype(np.float32)[:, None])), 0, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc.astype(np.float32)  # [n, 16]
    q = np.clip(np.rint(_safe_ratio(x, step[..., None])) + 32, 0, 63).astype(np.uint8)
    return SymmetricFields(d, sc, q)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """ggml's 12-byte packing of eight 6-bit scales and eight 6-bit mins: bytes 0-3 hold sc[0..3] and
    the top 2 bits of sc[4..7], bytes 4-7 m[0..3] and the top bits of m[4..7], bytes 8-11 the low
    nibbles of sc[4..7] (low) and m[4..7] (high)."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)  # [n, 12]
    out[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    return out


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    """[n] float16 -> [n, 2] little-endian bytes."""
    return values.astype("<f2").view(np.uint8).reshape(-1, 2)


def _nibble_pairs(q: np.ndarray) -> np.ndarray:
    """[n, 8, 32] 4-bit values -> [n, 128] bytes: byte 32c + l = q[2c][l] | q[2c+1][l] << 4."""
    low = q[:, 0::2, :] & 0x0F  # [n, 4, 32]
    high = q[:, 1::2, :] & 0x0F
    return (low | (high << 4)).reshape(q.shape[0], 128)


def pack_q4_k(f: AffineFields) -> np.ndarray:
    """[n, 144] bytes of block_q4_K: d, dmin, scales[12], qs[128]."""
    return np.concatenate(
        [_fp16_bytes(f.d), _fp16_bytes(f.dmin), _pack_scales(f.sc, f.m), _nibble_pairs(f.q)], axis=1
    )


def pack_q5_k(f: AffineFields) -> np.ndarray:
    """[n, 176] bytes of block_q5_K: d, dmin, scales[12], qh[32] (bit j of byte l: the fifth bit of
    sub-block j's value l), qs[128] (low nibbles as in Q4_K)."""
    high = (f.q >> 4) & 1  # [n, 8, 32]
    qh = np.zeros((f.q.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        qh |= (high[:, j, :] << j).astype(np.uint8)
    parts = [_fp16_bytes(f.d), _fp16_bytes(f.dmin), _pack_scales(f.sc, f.m), qh, _nibble_pairs(f.q)]
    return np.concatenate(parts, axis=1)


def pack_q6_k(f: SymmetricFields) -> np.ndarray:
    """[n, 210] bytes of block_q6_K: ql[128], qh[64], scales[16], d. Each 128-value half h: ql byte
    64h + l holds value 128h + l (low nibble) and 128h + 64 + l (high nibble); qh byte 32h + l holds
    the top 2 bits of values 128h + 32s + l at bits 2s."""
    n = f.q.shape[0]
    q = f.q.reshape(n, 2, 128)  # [n, half, 128]
    ql = (q[:, :, 0:64] & 0x0F) | ((q[:, :, 64:128] & 0x0F) << 4)  # [n, 2, 64]
    top = (q >> 4).reshape(n, 2, 4, 32)  # [n, half, s, l]
    qh = np.zeros((n, 2, 32), dtype=np.uint8)
    for s in range(4):
        qh |= (top[:, :, s, :] << (2 * s)).astype(np.uint8)
    parts = [ql.reshape(n, 128), qh.reshape(n, 64), f.sc.view(np.uint8), _fp16_bytes(f.d)]
    return np.concatenate(parts, axis=1)


def quantize_k(values: np.ndarray, kind: str) -> np.ndarray:
    """Rows [..., K] float (K a multiple of 256) -> [..., K / 256 * block_bytes] uint8 of `kind`."""
    if values.shape[-1] % QK_K:
        raise ValueError(f"{kind} needs rows of a multiple of {QK_K} values, got {values.shape[-1]}")
    blocks = values.astype(np.float32).reshape(-1, QK_K)  # [n, 256]
    if kind == "Q4_K":
        packed = pack_q4_k(affine_fields(blocks, 15))
    elif kind == "Q5_K":
        packed = pack_q5_k(affine_fields(blocks, 31))
    elif kind == "Q6_K":
        packed = pack_q6_k(symmetric_fields(blocks))
    else:
        raise ValueError(f"not a K-quant format this module writes: {kind}")
    return packed.reshape(*values.shape[:-1], -1)
