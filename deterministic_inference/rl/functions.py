"""Autograd functions around the engine's invariant kernels.

Every forward here runs the engine's own kernel on the same inputs, so its output has the engine's bits;
every backward is ordinary autograd math in plain torch (recomputed from saved inputs where that is
simplest), so gradients are correct but not bitwise. The kernels themselves are reached through the
engine's ops backend (`ops/backend.py`) and `ops/linear.py`; nothing here computes a forward value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from deterministic_inference.ops.attention import AttentionMetadata
from deterministic_inference.ops.linear import Linear
from deterministic_inference.ops.logprobs import log_softmax_rows

# one kernel call of the backend: (hidden, delta, weight, eps) -> (normed, hidden + delta)
AddRmsNorm = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
]


class LinearFn(torch.autograd.Function):
    """y = x W^T (+ b) by the engine's `Linear` (built from these weights); backward: the usual
    matmuls in the output's dtype (model dtype, or fp32 for the logits head), as plain autograd would."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, linear: Linear, x: torch.Tensor, bias: torch.Tensor | None, *parts: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(x, bias, *parts)
        return linear(x.detach())  # [T, out]: the kernel's bits

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, bias, *parts = ctx.saved_tensors
        compute = grad.dtype
        weight = torch.cat(parts) if len(parts) > 1 else parts[0]  # [out, in]
        grad_x = (grad @ weight.to(compute)).to(x.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = grad.sum(dim=0).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        grad_parts: list[torch.Tensor | None] = [None] * len(parts)
        if any(ctx.needs_input_grad[3:]):
            grad_weight = grad.t() @ x.to(compute)  # [out, in]
            sizes = [part.shape[0] for part in parts]
            grad_parts = [g.to(p.dtype) for g, p in zip(grad_weight.split(sizes), parts, strict=True)]
        return (None, grad_x, grad_bias, *grad_parts)


class AddRmsNormFn(torch.autograd.Function):
    """(RMSNorm(hidden + delta) * weight, hidden + delta) by the backend's kernel (run on a copy of
    `hidden`: the kernel adds in place); backward: autograd of HF's formula in fp32."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        kernel: AddRmsNorm,
        eps: float,
        hidden: torch.Tensor,  # [T, W]
        delta: torch.Tensor | None,  # [T, W]
        weight: torch.Tensor,  # [W]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        moved = None if delta is None else delta.detach()
        normed, summed = kernel(hidden.detach().clone(), moved, weight.detach(), eps)
        ctx.save_for_backward(summed, weight)
        ctx.eps, ctx.has_delta = eps, delta is not None
        return normed, summed

    @staticmethod
    def backward(
        ctx: Any, grad_normed: torch.Tensor, grad_summed: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        summed, weight = ctx.saved_tensors
        with torch.enable_grad():
            s = summed.detach().float().requires_grad_()
            w = weight.detach().float().requires_grad_()
            normed = w * (s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + ctx.eps))
            grad_s, grad_w = torch.autograd.grad(normed, (s, w), grad_normed.float())
        grad_sum = (grad_s + grad_summed.float()).to(summed.dtype)
        return None, None, grad_sum, grad_sum if ctx.has_delta else None, grad_w.to(weight.dtype)


class SiluMulFn(torch.autograd.Function):
    """silu(gate) * up by the backend's kernel; backward: autograd of the formula in fp32."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, kernel: Callable[[torch.Tensor], torch.Tensor], gate_up: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        return kernel(gate_up.detach())  # [T, I]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (gate_up,) = ctx.saved_tensors
        with torch.enable_grad():
            x = gate_up.detach().float().requires_grad_()
            inter = x.shape[1] // 2
            (grad_x,) = torch.autograd.grad(F.silu(x[:, :inter]) * x[:, inter:], (x,), grad.float())
        return None, grad_x.to(gate_up.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary of x [T, heads, D] by cos/sin [T, 1, D] in x's dtype (for backward only)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class RotaryFn(torch.autograd.Function):
    """q, k rotated and k, v written to the layer's cache by the backend's kernel -> (q [T, H, D] as the
    kernel returns it, k [T, KVH, D] and v [T, KVH, D] read back from the cache slots: exact copies of
    what attention will read); backward: autograd of the rotation in fp32."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        kernel: Callable[[torch.Tensor], torch.Tensor],  # qkv -> q; writes k, v to the cache
        read_back: Callable[[], tuple[torch.Tensor, torch.Tensor]],  # -> (k, v) from the cache slots
        tables: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, 1, D] fp32 at the tokens' positions
        shape: tuple[int, int, int],  # (H, KVH, D)
        qkv: torch.Tensor,  # [T, (H + 2 KVH) * D]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = kernel(qkv.detach())
        k, v = read_back()
        ctx.save_for_backward(qkv, *tables)
        ctx.shape = shape
        return q, k, v

    @staticmethod
    def backward(
        ctx: Any, grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        qkv, cos, sin = ctx.saved_tensors
        heads, kv_heads, dim = ctx.shape
        tokens = qkv.shape[0]
        with torch.enable_grad():
            x = qkv.detach().float().requires_grad_()
            q = x[:, : heads * dim].reshape(tokens, heads, dim)
            k = x[:, heads * dim : (heads + kv_heads) * dim].reshape(tokens, kv_heads, dim)
            v = x[:, (heads + kv_heads) * dim :].reshape(tokens, kv_heads, dim)
            outputs = (rotate(q, cos, sin), rotate(k, cos, sin), v)
            grads = (grad_q.float(), grad_k.float(), grad_v.float())
            (grad_x,) = torch.autograd.grad(outputs, (x,), grads)
        return None, None, None, None, grad_x.to(qkv.dtype)


class AttentionFn(torch.autograd.Function):
    """Causal attention by the backend's kernel (over the cache the rotary kernel filled); backward:
    autograd of fp32 SDPA per sequence over the differentiable k, v (every sequence starts at position 0
    in the policy's batches, so its keys are its own rows)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        kernel: Callable[[torch.Tensor], torch.Tensor],  # q [T, H, D] -> [T, H * D] model dtype
        meta: AttentionMetadata,
        scale: float,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
    ) -> torch.Tensor:
        ctx.save_for_backward(q, k, v)
        ctx.meta, ctx.scale = meta, scale
        return kernel(q.detach())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v = ctx.saved_tensors
        grads = [torch.zeros(t.shape, dtype=torch.float32) for t in (q, k, v)]
        heads, dim = q.shape[1], q.shape[2]
        for rows in ctx.meta.sequences:
            if rows.start_position != 0:
                raise ValueError("attention backward: every sequence must start at position 0 in the batch")
            span = slice(rows.first_row, rows.first_row + rows.num_rows)
            with torch.enable_grad():
                inputs = [t[span].detach().float().transpose(0, 1).requires_grad_() for t in (q, k, v)]
                queries, keys, values = inputs  # [H, n, D], [KVH, n, D], [KVH, n, D]
                out = F.scaled_dot_product_attention(
                    queries, keys, values, is_causal=True, scale=ctx.scale, enable_gqa=True
                )
                upstream = grad[span].float().reshape(rows.num_rows, heads, dim).transpose(0, 1)
                found = torch.autograd.grad(out, inputs, upstream)  # each [heads, n, D]
            for total, part in zip(grads, found, strict=True):
                total[span] = part.transpose(0, 1)
        return None, None, None, grads[0].to(q.dtype), grads[1].to(k.dtype), grads[2].to(v.dtype)


class TokenLogprobsFn(torch.autograd.Function):
    """Logprob of each row's target token: the engine's logits head (`Linear`, fp32 out), then
    `log_softmax_rows` (the engine's one logprob function), then a gather; in row chunks (rows are
    invariant, so chunking changes no bit) keeping only [R] outputs. Backward recomputes each chunk's
    logits and uses d logp / d logits = onehot - softmax, in fp32."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        head: Linear,
        chunk_rows: int,
        hidden: torch.Tensor,  # [R, hidden] model dtype
        targets: torch.Tensor,  # [R] int64
        weight: torch.Tensor,  # [V, hidden] the head's weight
    ) -> torch.Tensor:
        out = torch.empty(hidden.shape[0], dtype=torch.float32)  # [R]
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            logprobs = log_softmax_rows(head(hidden[rows].detach()))  # [c, V] fp32
            out[rows] = logprobs.gather(1, targets[rows, None]).squeeze(1)
        ctx.save_for_backward(hidden, targets, weight)
        ctx.head, ctx.chunk_rows = head, chunk_rows
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, targets, weight = ctx.saved_tensors
        weight32 = weight.float()  # [V, hidden]
        grad_hidden = torch.empty(hidden.shape, dtype=torch.float32)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32)
        for start in range(0, hidden.shape[0], ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            upstream = grad[rows, None]  # [c, 1]
            grad_logits = torch.softmax(ctx.head(hidden[rows]), dim=1) * -upstream  # [c, V]
            grad_logits.scatter_add_(1, targets[rows, None], upstream)
            grad_hidden[rows] = grad_logits @ weight32
            grad_weight += grad_logits.t() @ hidden[rows].float()
        return None, None, grad_hidden.to(hidden.dtype), None, grad_weight.to(weight.dtype)
