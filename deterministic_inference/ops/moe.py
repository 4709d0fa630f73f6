"""Mixture-of-experts routing and the weighted sum of expert outputs (the backends' `moe_route` and
`moe_combine`).

The compiled versions (ops/csrc/moe.c) are per token and fixed by the source: a token's experts, their
weights and its output are functions of its own router logits and its own expert rows, whatever the
batch, the expert loads or the thread count (the C file defines every operation). The torch versions
follow transformers (softmax over all experts, `torch.topk`, sums in the model dtype): the plain backend
for benchmarks and negative controls.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from deterministic_inference.ops.native import NativeKernels

MAX_EXPERTS = 4096  # csrc/moe.c


def route_native(
    kernels: NativeKernels,
    logits: torch.Tensor,  # [T, E] fp32: the token's router logits
    k: int,
    normalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (expert ids [T, k] int64 ascending per token, weights [T, k] fp32).

    Why invariant: each token's selection (ties to the lower index) and weights are a fixed sequence of
    fp32 operations on its own logits row (csrc/moe.c)."""
    if logits.dtype != torch.float32 or logits.dim() != 2:
        raise ValueError("moe_route: logits must be fp32 [tokens, experts]")
    tokens, experts = logits.shape
    if not 1 <= experts <= MAX_EXPERTS or not 1 <= k <= experts:
        raise ValueError(f"moe_route: {experts} experts, top {k}: need 1 <= k <= experts <= {MAX_EXPERTS}")
    logits = logits.contiguous()
    ids = torch.empty((tokens, k), dtype=torch.int64)
    weights = torch.empty((tokens, k), dtype=torch.float32)
    if tokens:
        _library(kernels).detinf_moe_route(
            logits.data_ptr(), tokens, experts, k, int(normalize), ids.data_ptr(), weights.data_ptr()
        )
    return ids, weights


def combine_native(
    kernels: NativeKernels,
    y: torch.Tensor,  # [R, H] model dtype: expert output rows
    rows: torch.Tensor,  # [T, k] int64: the row of y for each token's slot, in summation order
    weights: torch.Tensor,  # [T, k] fp32
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([T, H] model dtype, gate logits [T] fp32)
) -> torch.Tensor:
    """-> [T, H] in y's dtype: per token, the weighted expert rows summed in slot order in fp32 (then the
    sigmoid-gated shared expert), rounded once. Invariant: a function of the token's own rows."""
    tokens, k = rows.shape
    width = y.shape[1]
    if y.dtype not in (torch.float32, torch.bfloat16) or y.dim() != 2:
        raise ValueError("moe_combine: expert rows must be fp32 or bf16 [rows, hidden]")
    if rows.dtype != torch.int64 or weights.dtype != torch.float32 or weights.shape != rows.shape:
        raise ValueError("moe_combine: rows int64 [T, k] and weights fp32 [T, k] expected")
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= y.shape[0]):
        raise ValueError(f"moe_combine: a slot's row is outside [0, {y.shape[0]})")
    shared_ptr = gate_ptr = None
    if shared is not None:
        values, gate = shared[0].contiguous(), shared[1].contiguous()
        if values.shape != (tokens, width) or values.dtype != y.dtype or gate.shape != (tokens,):
            raise ValueError("moe_combine: shared expert rows [T, H] and gate logits [T] expected")
        if gate.dtype != torch.float32:
            raise ValueError("moe_combine: the shared expert's gate logits must be fp32")
        shared, shared_ptr, gate_ptr = (values, gate), values.data_ptr(), gate.data_ptr()
    y, rows, weights = y.contiguous(), rows.contiguous(), weights.contiguous()
    out = torch.empty((tokens, width), dtype=y.dtype)
    if tokens:
        _library(kernels).detinf_moe_combine(
            y.data_ptr(), rows.data_ptr(), weights.data_ptr(), tokens, k, width, shared_ptr, gate_ptr,
            out.data_ptr(), int(y.dtype == torch.bfloat16),
        )  # fmt: skip
    return out


def route_torch(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' router: softmax over every expert in fp32, `torch.topk`, optionally renormalised;
    -> (ids [T, k] ascending, weights [T, k] fp32). Not guaranteed invariant (plain torch ops)."""
    probs = F.softmax(logits.float(), dim=-1)  # [T, E]
    top, ids = torch.topk(probs, k, dim=-1)  # [T, k]
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    ids, slot = ids.sort(dim=-1)
    return ids, top.gather(1, slot)


def combine_torch(
    y: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """transformers' sum: each slot's row times its weight (in the model dtype) added in slot order."""
    out = torch.zeros((rows.shape[0], y.shape[1]), dtype=y.dtype)
    for j in range(rows.shape[1]):
        out = out + y[rows[:, j]] * weights[:, j : j + 1].to(y.dtype)
    if shared is not None:
        out = out + torch.sigmoid(shared[1]).to(y.dtype)[:, None] * shared[0]
    return out


@functools.cache
def _library(kernels: NativeKernels) -> ctypes.CDLL:
    """The kernels' library with the MoE entry points' C signatures declared (once per build)."""
    library = kernels.library
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    library.detinf_moe_route.restype = ctypes.c_int
    library.detinf_moe_route.argtypes = [pointer, i64, i64, i64, ctypes.c_int, pointer, pointer]
    library.detinf_moe_combine.restype = None
    library.detinf_moe_combine.argtypes = [*(pointer,) * 3, i64, i64, i64, *(pointer,) * 3, ctypes.c_int]
    return library
