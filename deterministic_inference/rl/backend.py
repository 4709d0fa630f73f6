"""`TrainableBackend`: the engine's invariant ops backend with a backward pass.

It implements the `OpsBackend` protocol, so the engine's own decoder (`model/decoder.py`) runs on it
unchanged: each op forwards to the `NativeBackend` the engine would use (same kernels, same calls, so the
same bits) inside an autograd function of `rl/functions.py`, whose backward is ordinary torch math.
Weights are the policy's live tensors: every linear builds the engine's `Linear` from their current
values when first called (one forward), so an optimizer step is seen by the next forward.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from deterministic_inference.model_spec import RopeScaling
from deterministic_inference.ops.attention import AttentionMetadata
from deterministic_inference.ops.backend import KVCache, NativeBackend, Numerics, SharedExpert
from deterministic_inference.ops.linear import Linear, LinearWeight
from deterministic_inference.ops.rope import RotaryTable
from deterministic_inference.ops.weights import Embedding, StoredWeight, dtype_format
from deterministic_inference.rl import functions


class LayerKV(tuple[torch.Tensor, torch.Tensor]):
    """A layer's scratch paged cache (keys [blocks, KVH, D, block], values [blocks, KVH, block, D]) for
    one policy forward, plus the differentiable k, v [T, KVH, D] the rotary op wrote into it (what
    attention's backward differentiates through)."""

    written: tuple[torch.Tensor, torch.Tensor] | None = None


class TrainableLinear(Linear):
    """A linear over live weight tensors: the engine's `Linear` (built on first call from their current
    values) forward, `functions.LinearFn` backward. A `Linear` for the decoder's type, but it does not
    run `Linear.__init__`: nothing is packed until the first call."""

    def __init__(self, ops: NativeBackend, parts: list[torch.Tensor], bias: torch.Tensor | None, head: bool):
        dtype = ops.numerics.dtype
        self._ops, self._parts, self._bias, self._head = ops, parts, bias, head
        self._built: Linear | None = None
        self.formats = (dtype_format(dtype),) * len(parts)
        self.out_features = sum(part.shape[0] for part in parts)
        self.in_features = parts[0].shape[1]
        self.out_dtype = torch.float32 if head else dtype
        self.batch_invariant = True
        self.backend = "trainable"

    @property
    def weight_parts(self) -> list[torch.Tensor]:
        """The live weight tensors [N_i, in] (stacked by rows)."""
        return self._parts

    def kernel(self) -> Linear:
        """The engine's linear for the weights' current values (built once per instance)."""
        if self._built is None:
            parts = [part.detach() for part in self._parts]
            bias = None if self._bias is None else self._bias.detach()
            self._built = self._ops.logits_head(parts) if self._head else self._ops.linear(parts, bias)
        return self._built

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]: the engine's bits, differentiable in x, the weights and the bias."""
        result: torch.Tensor = functions.LinearFn.apply(self.kernel(), x, self._bias, *self._parts)
        return result


def _tensors(weight: LinearWeight) -> list[torch.Tensor]:
    """The live weight tensors of a linear (one matrix, or parts stacked by rows)."""
    parts: Sequence[StoredWeight] = weight if isinstance(weight, Sequence) else [weight]
    tensors = [part for part in parts if isinstance(part, torch.Tensor)]
    if len(tensors) != len(parts):
        raise TypeError("the trainable policy computes dense weights only (load with quantization 'none')")
    return tensors


class TrainableBackend:
    """The `OpsBackend` of the policy's forward: `NativeBackend`'s kernels with a backward pass."""

    name = "trainable"

    def __init__(self, native: NativeBackend) -> None:
        self.native = native
        self.numerics: Numerics = native.numerics

    @property
    def portable(self) -> bool:
        """The native backend's kernels compute the forward: as portable as they are."""
        return self.native.portable

    def linear(self, weight: LinearWeight, bias: torch.Tensor | None = None) -> Linear:
        return TrainableLinear(self.native, _tensors(weight), bias, head=False)

    def logits_head(self, weight: LinearWeight) -> Linear:
        return TrainableLinear(self.native, _tensors(weight), None, head=True)

    def embedding(self, weight: StoredWeight) -> Embedding:
        """The engine's lookup (row copies) over the live table: differentiable as torch indexing."""
        return self.native.embedding(weight)

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused kernel on a copy of `hidden` (so autograd's saved tensors are never overwritten)."""
        normed: torch.Tensor
        summed: torch.Tensor
        normed, summed = functions.AddRmsNormFn.apply(self.native.add_rms_norm, eps, hidden, delta, weight)
        return normed, summed

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Qwen3's per-head q/k norm: the engine's RMSNorm kernel (the fused one with no residual), with
        the same backward as `add_rms_norm`."""
        rows = x.reshape(-1, x.shape[-1]).contiguous()  # [N, W], as NativeBackend.rms_norm passes it
        normed: torch.Tensor
        normed, _ = functions.AddRmsNormFn.apply(self.native.add_rms_norm, eps, rows, None, weight)
        return normed.reshape(x.shape)

    def rotary_table(
        self, head_dim: int, theta: float, max_positions: int, scaling: RopeScaling | None
    ) -> RotaryTable:
        """The engine's tables (constants: no gradient)."""
        return self.native.rotary_table(head_dim, theta, max_positions, scaling)

    def log_softmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """The policy computes logprobs itself (rl/policy.py, through `ops.logprobs`); the decoder never
        calls this."""
        return self.native.log_softmax_rows(logits)

    def moe_route(self, logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Mixture-of-experts policies are not trainable yet: refused when the policy is built."""
        raise NotImplementedError("the trainable policy supports dense models only (not mixture-of-experts)")

    def moe_combine(
        self, y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, shared: SharedExpert | None
    ) -> torch.Tensor:
        raise NotImplementedError("the trainable policy supports dense models only (not mixture-of-experts)")

    def rotary_write_kv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryTable,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        heads: int,
    ) -> torch.Tensor:
        """The kernel rotates q, k and writes k, v to the scratch cache; k, v read back from their slots
        are kept on the `LayerKV` for attention's backward."""
        if not isinstance(kv_cache, LayerKV):
            raise TypeError("the trainable backend needs LayerKV scratch caches (see rl/policy.py)")
        kv_heads, dim = kv_cache[0].shape[1], kv_cache[0].shape[2]
        kernel = functools.partial(
            self.native.rotary_write_kv, positions=positions, rotary=rotary, meta=meta, kv_cache=kv_cache,
            heads=heads,
        )  # fmt: skip

        def read_back() -> tuple[torch.Tensor, torch.Tensor]:
            index = (meta.write_blocks, meta.write_offsets)
            keys = kv_cache[0].permute(0, 3, 1, 2)[index]  # [T, KVH, D]
            values = kv_cache[1].permute(0, 2, 1, 3)[index]  # [T, KVH, D]
            return keys, values

        tables = (rotary.cos[positions].unsqueeze(1), rotary.sin[positions].unsqueeze(1))  # [T, 1, D] fp32
        q, k, v = functions.RotaryFn.apply(kernel, read_back, tables, (heads, kv_heads, dim), qkv)
        kv_cache.written = (k, v)
        result: torch.Tensor = q
        return result

    def attention(
        self,
        q: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """The compiled kernel over the scratch cache; backward through the k, v the rotary op wrote."""
        if window > 0 or softcap > 0:
            raise NotImplementedError("the trainable backend has no sliding-window or soft-capped attention")
        if not isinstance(kv_cache, LayerKV) or kv_cache.written is None:
            raise TypeError("attention: the layer's rotary op has not written this LayerKV")
        kernel = functools.partial(self.native.attention, kv_cache=kv_cache, meta=meta, scale=scale)
        k, v = kv_cache.written
        out: torch.Tensor = functions.AttentionFn.apply(kernel, meta, scale, q, k, v)
        return out

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("the trainable backend has no GELU-tanh MLP (its backward)")

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        raise NotImplementedError("the trainable backend has no logit soft-capping (its backward)")

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = functions.SiluMulFn.apply(self.native.silu_mul, gate_up)
        return out
