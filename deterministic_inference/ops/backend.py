"""The ops backend seam: the decoder is written once against `OpsBackend`; a backend is picked once,
when the model is built, by `select_backend` (the one place that decides which kernels run).

- `NativeBackend` (invariant mode): the compiled kernels of `ops/native.py` and `ops/portable.py`
  (attention, RMSNorm fused with the residual add, silu_mul, rotary tables + KV write, the bf16, fp32 and
  quantized GEMMs, log_softmax). Every op's rows are invariant by construction; the start-up self-check
  proves it per machine. Every rounding operation runs in our kernels, so the bits are also the same on
  any x86-64 CPU and for any -march of the kernels (portable numerics): torch only moves data and casts.
- `TorchBackend` (`batch_invariant=False`): plain torch ops, for benchmarks and the negative controls of
  the tests. Its outputs may depend on the batch and on the CPU.

A GPU backend would be a third class here. Per-token overhead matters (single-stream decode calls every
op of every layer once per token), so the methods forward to the kernels with no extra work.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from deterministic_inference.errors import ConfigError
from deterministic_inference.model_spec import RopeScaling
from deterministic_inference.ops.attention import AttentionMetadata, paged_attention, write_kv
from deterministic_inference.ops.kv_format import cache_head_dim
from deterministic_inference.ops.linear import Linear, LinearWeight
from deterministic_inference.ops.moe import combine_native, combine_torch, route_native, route_torch
from deterministic_inference.ops.native import NativeKernels, native_kernels
from deterministic_inference.ops.norm import rms_norm
from deterministic_inference.ops.portable import TORCH_LOG_SOFTMAX_ENV, log_softmax_rows
from deterministic_inference.ops.rope import RotaryTable
from deterministic_inference.ops.weights import Embedding, StoredWeight, dense

# A shared expert's output rows [T, H] (model dtype) and its gate logits [T] fp32
SharedExpert = tuple[torch.Tensor, torch.Tensor]
# One layer's paged cache: (keys [blocks, KVH, D, block_size], values [blocks, KVH, block_size, D])
KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Numerics:
    """How the ops compute: dtype, invariance switch, GEMM row tile, and whether the bf16 GEMM runs on the
    CPU's AMX-BF16 tiles (`--numerics native`: bits fixed per CPU class, not by our source)."""

    dtype: torch.dtype
    batch_invariant: bool
    tile_rows: int
    native_gemm: bool = False


class OpsBackend(Protocol):
    """The ops a decoder layer is written against. Activations are [T, width] in the model dtype."""

    name: str
    numerics: Numerics

    @property
    def portable(self) -> bool:
        """True when every rounding operation runs in our kernels (bits fixed by their source, the same
        on any x86-64 CPU): the fingerprint then leaves the CPU out of what can change bits."""
        ...

    def linear(self, weight: LinearWeight, bias: torch.Tensor | None = None) -> Linear:
        """x [T, in] -> [T, out] in the model dtype; `weight` may stack several stored parts by rows."""
        ...

    def logits_head(self, weight: LinearWeight) -> Linear:
        """hidden [R, hidden] -> fp32 logits [R, vocab]."""
        ...

    def embedding(self, weight: StoredWeight) -> Embedding:
        """token ids [T] -> [T, hidden] (a fresh tensor the layers may update in place)."""
        ...

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (RMSNorm(hidden + delta) * weight, hidden + delta): the residual add, then the norm."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension (Qwen3's per-head q/k norms)."""
        ...

    def rotary_write_kv(
        self,
        qkv: torch.Tensor,  # [T, (H + 2 KVH) * D]
        positions: torch.Tensor,  # [T] int64
        rotary: RotaryTable,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        heads: int,
    ) -> torch.Tensor:
        """Rotate q and k by position, write k and v to their cache slots -> rotated q [T, H, D]."""
        ...

    def attention(
        self,
        q: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """q [T, H, D] over each row's cached keys (the last `window` of them when > 0; scores soft-capped
        when `softcap` > 0) -> [T, H * D] in the model dtype."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2I] (gate then up) -> silu(gate) * up [T, I]."""
        ...

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2I] (gate then up) -> gelu_tanh(gate) * up [T, I] (GeGLU)."""
        ...

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        """fp32 x -> tanh(x / cap) * cap (Gemma 2's logit soft-capping), a new fp32 tensor."""
        ...

    def moe_route(self, logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [T, E] fp32 -> (top-k expert ids [T, k] int64 ascending, weights [T, k] fp32);
        `normalize`: softmax over the chosen experts (else their full-softmax probabilities)."""
        ...

    def moe_combine(
        self, y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, shared: SharedExpert | None
    ) -> torch.Tensor:
        """Expert rows y [R, H], each token's slot rows [T, k] and weights [T, k] -> [T, H]: the weighted
        rows summed in slot order (+ the sigmoid-gated shared expert)."""
        ...

    def rotary_table(
        self, head_dim: int, theta: float, max_positions: int, scaling: RopeScaling | None
    ) -> RotaryTable:
        """The cos / sin tables of every position (fp32 [max_positions, head_dim])."""
        ...

    def log_softmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """Logprobs: log_softmax over the last dimension of fp32 logits [..., V] -> fp32 [..., V]. The
        native backend's is the sampler's own function (`ops.portable.log_softmax_rows`), so a trainer's
        forward pass gets the sampler's logprob bits."""
        ...


class NativeBackend:
    """Invariant mode: the compiled kernels (see the module docstring)."""

    name = "native"

    def __init__(self, numerics: Numerics, kernels: NativeKernels) -> None:
        self.numerics = numerics
        self.kernels = kernels

    @property
    def portable(self) -> bool:
        """True, unless the bf16 GEMM runs on the CPU's AMX-BF16 tiles (native numerics) or a test put
        torch's log_softmax back on the path (`ops.portable`)."""
        return not self.numerics.native_gemm and os.environ.get(TORCH_LOG_SOFTMAX_ENV) != "1"

    def linear(self, weight: LinearWeight, bias: torch.Tensor | None = None) -> Linear:
        """The kernels' linear; under native numerics a bf16 weight's GEMM runs on the AMX-BF16 tiles."""
        numerics = self.numerics
        return Linear(
            weight, bias, batch_invariant=True, kernels=self.kernels,
            out_dtype=numerics.dtype, dtype=numerics.dtype, native_gemm=numerics.native_gemm,
        )  # fmt: skip

    def logits_head(self, weight: LinearWeight) -> Linear:
        """fp32 sums of the model-dtype weight and hidden state (see Linear)."""
        numerics = self.numerics
        return Linear(
            weight, None, batch_invariant=True, kernels=self.kernels,
            out_dtype=torch.float32, dtype=numerics.dtype, native_gemm=numerics.native_gemm,
        )  # fmt: skip

    def embedding(self, weight: StoredWeight) -> Embedding:
        return Embedding(weight, self.numerics.dtype)

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel adds `delta` into `hidden` in place (one rounding, like torch's add), then norms each
        row with a fixed-order sum of squares over that row only."""
        return self.kernels.add_rms_norm(hidden, delta, weight, eps), hidden

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """The RMSNorm kernel over the last dimension (each row alone, fixed-order sum of squares; torch's
        reduction would take its order from the CPU's vector width)."""
        rows = x.reshape(-1, x.shape[-1]).contiguous()  # [N, W]
        return self.kernels.add_rms_norm(rows, None, weight.contiguous(), eps).reshape(x.shape)

    def rotary_write_kv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryTable,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        heads: int,
    ) -> torch.Tensor:
        """Elementwise per token (rotation read by absolute position): invariant; q comes back fp32."""
        return self.kernels.rotary_write_kv(
            qkv, positions, rotary.cos, rotary.sin, meta.write_blocks, meta.write_offsets,
            kv_cache[0], kv_cache[1], heads,
        )  # fmt: skip

    def attention(
        self,
        q: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """The compiled kernel: each row alone over its own keys (its window's) in a source-fixed order."""
        out = paged_attention(
            q,
            kv_cache[0],
            kv_cache[1],
            meta,
            scale=scale,
            kernels=self.kernels,
            window=window,
            softcap=softcap,
        )
        return out.to(self.numerics.dtype).reshape(q.shape[0], -1)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Elementwise in fp32 with the kernels' own exp: each element a function of its inputs only."""
        return self.kernels.silu_mul(gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Elementwise in fp32 with the kernels' own tanh (csrc/rowwise.c): each element from its inputs."""
        return self.kernels.gelu_tanh_mul(gate_up)

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        """Elementwise with the kernels' own tanh: the same bits on every CPU."""
        return self.kernels.softcap(x, cap)

    def moe_route(self, logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The compiled router: per token, from its own logits only (ties to the lower expert index)."""
        return route_native(self.kernels, logits, k, normalize)

    def moe_combine(
        self, y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, shared: SharedExpert | None
    ) -> torch.Tensor:
        """The compiled sum: per token, fp32 in slot order, one rounding (csrc/moe.c)."""
        return combine_native(self.kernels, y, rows, weights, shared)

    def rotary_table(
        self, head_dim: int, theta: float, max_positions: int, scaling: RopeScaling | None
    ) -> RotaryTable:
        """Tables from the portable kernels (our own pow / sin / cos): the same bits on every CPU."""
        return RotaryTable(head_dim, theta, max_positions, scaling, kernels=self.kernels)

    def log_softmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """`ops.portable.log_softmax_rows` with this backend's kernels: the sampler's function."""
        return log_softmax_rows(logits, self.kernels)


class TorchBackend:
    """`batch_invariant=False`: plain torch ops (not reproducible across batches). Quantized weights are
    dequantised to the model dtype when the model is built (memory as with --quantization none)."""

    name = "torch"

    def __init__(self, numerics: Numerics) -> None:
        self.numerics = numerics

    @property
    def portable(self) -> bool:
        """False: torch's kernels dispatch on the CPU's ISA."""
        return False

    def linear(self, weight: LinearWeight, bias: torch.Tensor | None = None) -> Linear:
        numerics = self.numerics
        return Linear(
            weight, bias, batch_invariant=False, out_dtype=numerics.dtype,
            dtype=numerics.dtype,
        )  # fmt: skip

    def logits_head(self, weight: LinearWeight) -> Linear:
        numerics = self.numerics
        return Linear(
            weight, None, batch_invariant=False, out_dtype=torch.float32,
            dtype=numerics.dtype,
        )  # fmt: skip

    def embedding(self, weight: StoredWeight) -> Embedding:
        """A dense table (a quantized one dequantised here, at build)."""
        return Embedding(dense(weight, self.numerics.dtype), self.numerics.dtype)

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is not None:
            hidden = hidden + delta
        return rms_norm(hidden, weight, eps), hidden

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def rotary_write_kv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryTable,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        heads: int,
    ) -> torch.Tensor:
        """rotary.apply in the model dtype (HF's rounding), then index_put into the cache."""
        tokens = qkv.shape[0]
        kv_heads, dim = kv_cache[0].shape[1], cache_head_dim(kv_cache[0])
        q, k, v = split_heads(qkv, tokens, (heads, kv_heads, dim))
        q = rotary.apply(q, positions)
        write_kv(kv_cache[0], kv_cache[1], rotary.apply(k, positions), v, meta)
        return q

    def attention(
        self,
        q: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """SDPA per sequence over its cached keys (fp32 inside), rounded to the model dtype."""
        out = paged_attention(
            q, kv_cache[0], kv_cache[1], meta, scale=scale, kernels=None, window=window, softcap=softcap
        )
        return out.to(self.numerics.dtype).reshape(q.shape[0], -1)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        inter = gate_up.shape[1] // 2
        return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        inter = gate_up.shape[1] // 2
        return F.gelu(gate_up[:, :inter], approximate="tanh") * gate_up[:, inter:]

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        return torch.tanh(x / cap) * cap

    def moe_route(self, logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return route_torch(logits, k, normalize)

    def moe_combine(
        self, y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, shared: SharedExpert | None
    ) -> torch.Tensor:
        return combine_torch(y, rows, weights, shared)

    def rotary_table(
        self, head_dim: int, theta: float, max_positions: int, scaling: RopeScaling | None
    ) -> RotaryTable:
        """torch's pow / cos / sin (ISA-dispatched)."""
        return RotaryTable(head_dim, theta, max_positions, scaling)

    def log_softmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """torch.log_softmax in fp32 (ISA-dispatched)."""
        return torch.log_softmax(logits.to(torch.float32), dim=-1)


def split_heads(
    qkv: torch.Tensor, tokens: int, shape: tuple[int, int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (H + 2*KVH) * D] -> q [T, H, D], k [T, KVH, D], v [T, KVH, D] (views); shape = (H, KVH, D)."""
    heads, kv_heads, dim = shape
    q_size, kv_size = heads * dim, kv_heads * dim
    q = qkv[:, :q_size].reshape(tokens, heads, dim)
    k = qkv[:, q_size : q_size + kv_size].reshape(tokens, kv_heads, dim)
    v = qkv[:, q_size + kv_size :].reshape(tokens, kv_heads, dim)
    return q, k, v


def select_backend(numerics: Numerics, kernels: NativeKernels | None = None) -> OpsBackend:
    """The backend for `numerics`: the compiled kernels in invariant mode (`kernels`, default this
    process's build; raises NativeBuildError without a compiler), plain torch otherwise. Native numerics
    (`numerics.native_gemm`) need the invariant kernels and this CPU's AMX-BF16 tiles: ConfigError naming
    `--numerics` and what is missing otherwise (never a silent fall back to the portable GEMM)."""
    if numerics.native_gemm and not numerics.batch_invariant:
        raise ConfigError("--numerics native runs the invariant kernels: drop --no-batch-invariant")
    if numerics.batch_invariant:
        kernels = kernels if kernels is not None else native_kernels()
        missing = kernels.native_gemm_missing() if numerics.native_gemm else None
        if missing is not None:
            raise ConfigError(f"--numerics native: {missing}; use --numerics portable on this machine")
        return NativeBackend(numerics, kernels)
    return TorchBackend(numerics)
