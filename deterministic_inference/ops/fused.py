"""The decode fast path: every decoder layer of a step in ONE call into the compiled kernels (csrc/decoder.c).

The per-op path calls ~10 kernels per layer from Python, each behind a wrapper that checks its tensors
and allocates its output: at one token per step that Python work costs about as much as the arithmetic
on a small model. `FusedDecoder` describes each layer once (weights, GEMM descriptors) as C structs,
checks the step's inputs once, and lets C call the same kernel entry points with the same arguments in
the same order. Why the bits are the per-op path's: no kernel is replaced and no arithmetic is added
(the only conversion, the attention output's fp32 -> bf16, is torch's round-to-nearest-even); tests
compare both paths bit for bit, with a negative control.

It serves models whose every layer runs on the native backend with kernel-backed linears (quantized
blocks, or bf16 weights on the bf16 GEMM), no per-head q/k norm and no sliding window; `FusedDecoder.build`
returns None otherwise and the per-op path runs.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
from collections.abc import Sequence
from typing import Protocol

import torch

from deterministic_inference.model_spec import ModelSpec
from deterministic_inference.ops.attention import AttentionMetadata
from deterministic_inference.ops.backend import OpsBackend
from deterministic_inference.ops.kv_format import cache_code, cache_head_dim
from deterministic_inference.ops.linear import Linear
from deterministic_inference.ops.native import NativeKernels, check_caches
from deterministic_inference.ops.rope import RotaryTable

KVCache = tuple[torch.Tensor, torch.Tensor]
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
# csrc/decoder.c's linear kinds (the AMX ones: --numerics native)
LINEAR_QUANT, LINEAR_BF16, LINEAR_BF16_AMX, LINEAR_QUANT_AMX = 1, 2, 3, 4
# csrc/decoder.c's PHASE_* in order: what `FusedDecoder.phase_seconds` accumulates (bench/profile_engine.py)
PHASES = (
    "norms", "qkv", "rotary + KV write", "attention", "attention -> bf16", "o_proj", "gate_up", "silu_mul",
    "down",
)  # fmt: skip
_ERRORS = {
    1: (ValueError, "rotary_write_kv: a position, cache block or slot offset is out of range"),
    2: (ValueError, "attention kernel: a row sees no key or its block table is out of range"),
    3: (MemoryError, "attention kernel could not allocate its workspace"),
    4: (MemoryError, "a GEMM (quantized, or the AMX-BF16 one) could not allocate its work space"),
    5: (ValueError, "fused decoder: a linear has no kernel for this dtype"),
}


class _Linear(ctypes.Structure):
    """Mirror of csrc/decoder.c's detinf_linear."""

    _fields_ = [
        ("kind", _I64),
        ("parts", _P),
        ("nparts", _I64),
        ("packed", _P),
        ("bias", _P),
        ("n", _I64),
        ("k", _I64),
    ]


class _Layer(ctypes.Structure):
    """Mirror of detinf_layer."""

    _fields_ = [
        ("input_norm", _P), ("post_norm", _P), ("qkv", _Linear), ("o_proj", _Linear), ("gate_up", _Linear),
        ("down", _Linear), ("k_cache", _P), ("v_cache", _P),
    ]  # fmt: skip


class _Step(ctypes.Structure):
    """Mirror of detinf_step."""

    _fields_ = [
        *((name, _I64) for name in ("tokens", "hidden", "heads", "kv_heads", "head_dim", "inter")),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("model_bf16", _I64), ("flags", _I64),
        ("kv_dtype", _I64),
        ("positions", _P), ("cos", _P), ("sin", _P), ("table_rows", _I64),
        *((name, _P) for name in ("write_blocks", "write_offsets", "block_ids", "row_table", "row_keys")),
        ("num_ids", _I64), ("num_blocks", _I64), ("block_size", _I64),
        *((name, _P) for name in ("normed", "qkv", "q32", "att32", "att", "delta", "gate_up", "act")),
        ("phase_seconds", _P), ("silu_table", _P),
    ]  # fmt: skip


class DenseGatedMLP(Protocol):
    """A dense gated MLP as the fused path runs it: down(act(gate_up(x))), gate and up in one linear."""

    @property
    def gate_up(self) -> Linear:  # [2 * inter, hidden]: gate rows, then up rows
        ...

    @property
    def down(self) -> Linear:  # [hidden, inter]
        ...


class FusableLayer(Protocol):
    """What the fused path reads of a decoder layer (model/ implements it; ops/ never names a model class).
    The fused kernel runs the Llama pre-norm block's sequence of kernels (SiLU-gated MLP included), so a
    layer qualifies only when its own `__call__` is that sequence (`fusable`), with no q/k norm, no
    window and a dense MLP."""

    @property
    def spec(self) -> ModelSpec: ...

    @property
    def ops(self) -> OpsBackend: ...

    @property
    def fusable(self) -> bool:  # the layer's block is the pre-norm Llama block, kernel for kernel
        ...

    @property
    def window(self) -> int:  # sliding window in keys (0: none)
        ...

    @property
    def q_norm(self) -> torch.Tensor | None:  # [head_dim] per-head q norm (qwen3), None: none
        ...

    @property
    def qkv(self) -> Linear:  # [(H + 2*KVH) * D, hidden]
        ...

    @property
    def o_proj(self) -> Linear:  # [hidden, H * D]
        ...

    @property
    def input_norm(self) -> torch.Tensor:  # [hidden]
        ...

    @property
    def post_attention_norm(self) -> torch.Tensor:  # [hidden]
        ...

    def dense_mlp(self) -> DenseGatedMLP | None:
        """The layer's MLP when it is a dense gated MLP, None otherwise (a mixture of experts)."""
        ...


def _linear_struct(linear: Linear, model_dtype: torch.dtype) -> _Linear | None:
    """The C descriptor of a kernel-backed linear, or None when it runs on torch (fp32 oneDNN)."""
    quant, kind = linear.quant_linear, LINEAR_QUANT
    if quant is None and linear.quant_tiles is not None and model_dtype == torch.bfloat16:
        quant, kind = linear.quant_tiles, LINEAR_QUANT_AMX  # the per-op path's QuantLinear.on_tiles
    if quant is not None:
        table = ctypes.addressof(quant.table)
        count, bias_at = len(quant.parts), quant.bias_pointer
        return _Linear(kind, table, count, None, bias_at, quant.out_features, quant.in_features)
    native = linear.native_weight
    if native is None or model_dtype != torch.bfloat16:
        return None
    packed, bias = native
    bias_pointer = None if bias is None else bias.data_ptr()
    kind = LINEAR_BF16_AMX if linear.native_gemm else LINEAR_BF16  # the per-op path's GEMM
    return _Linear(kind, None, 0, packed.data_ptr(), bias_pointer, linear.out_features, linear.in_features)


class FusedDecoder:
    """The layers of one model as C structs, run in one call per step (see the module docstring)."""

    def __init__(
        self, kernels: NativeKernels, layers: Sequence[FusableLayer], structs: ctypes.Array[_Layer]
    ) -> None:
        self.layers = tuple(layers)  # keeps every weight the structs point to alive
        self._structs = structs
        self._run = _library(kernels).detinf_decoder_layers
        self._silu_table = kernels.silu_table  # detinf_silu_table's, read by every layer's silu_mul
        spec, dtype = layers[0].spec, layers[0].ops.numerics.dtype
        self.spec, self.dtype = spec, dtype
        self._bound: tuple[torch.Tensor, ...] = ()  # the cache tensors the structs point to (checked)
        # profiling only (bench/profile_engine.py): fp64 [len(PHASES)] seconds each phase took, summed
        # over the calls while set; None (the default) times nothing
        self.phase_seconds: torch.Tensor | None = None
        heads, kv_heads, dim, item = spec.num_heads, spec.num_kv_heads, spec.head_dim, dtype.itemsize
        # bytes per token of each scratch buffer: normed, qkv, att, delta, gate_up, act (model dtype),
        # then q32 and att32 (fp32)
        self._row_bytes = (
            *(width * item for width in (spec.hidden_size, (heads + 2 * kv_heads) * dim, heads * dim,
              spec.hidden_size, 2 * spec.intermediate_size, spec.intermediate_size)),
            heads * dim * 4, heads * dim * 4,
        )  # fmt: skip

    @classmethod
    def build(cls, kernels: NativeKernels | None, layers: Sequence[FusableLayer]) -> FusedDecoder | None:
        """The fused decoder of `layers`, or None when any layer needs the per-op path."""
        if kernels is None or not layers or layers[0].spec.head_dim > 1024:
            return None
        structs = (_Layer * len(layers))()
        for index, layer in enumerate(layers):
            dtype, mlp = layer.ops.numerics.dtype, layer.dense_mlp()
            if (
                layer.ops.name != "native"
                or not layer.fusable
                or layer.q_norm is not None
                or layer.window > 0  # sliding windows take the per-op path
                or mlp is None  # mixture-of-experts layers take the per-op path
                or dtype not in (torch.float32, torch.bfloat16)
            ):
                return None
            linears = [_linear_struct(lin, dtype) for lin in (layer.qkv, layer.o_proj, mlp.gate_up, mlp.down)]
            if any(lin is None for lin in linears):
                return None
            structs[index] = _Layer(
                layer.input_norm.data_ptr(), layer.post_attention_norm.data_ptr(), *linears
            )
        return cls(kernels, layers, structs)

    def __call__(
        self,
        hidden: torch.Tensor,  # [T, hidden] model dtype: the residual stream, updated in place
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_caches: Sequence[KVCache],
        rotary: RotaryTable,
        flags: int = 0,  # TEST_* of ops/quant.py for the quantized GEMMs: tests' negative controls only
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (residual stream, the last layer's MLP output still to be added): what the per-op loop
        over the layers' own `__call__` returns, bit for bit."""
        spec, dtype = self.spec, self.dtype
        tokens = hidden.shape[0]
        if hidden.dtype != dtype or hidden.shape != (tokens, spec.hidden_size) or not hidden.is_contiguous():
            raise ValueError(f"fused decoder: hidden must be contiguous {dtype} [T, {spec.hidden_size}]")
        if (
            tokens < 1
            or positions.shape != (tokens,)
            or meta.num_tokens != tokens
            or len(kv_caches) != len(self.layers)
        ):
            raise ValueError(
                "fused decoder: positions, metadata and caches must match the step's tokens and layers"
            )
        self._bind_caches(kv_caches, meta)
        if rotary.cos.dtype != torch.float32 or not (
            rotary.cos.is_contiguous() and rotary.sin.is_contiguous()
        ):
            raise ValueError("fused decoder: the rotary tables must be contiguous fp32")
        step, buffers = self._step(tokens, positions, meta, rotary, kv_caches[0][0], flags)
        pending = torch.empty_like(hidden)
        status = self._run(
            self._structs, len(self.layers), ctypes.byref(step), hidden.data_ptr(), pending.data_ptr(), 0
        )
        del buffers  # kept alive until the call returned
        if status:
            error, message = _ERRORS.get(status, (RuntimeError, f"fused decoder failed ({status})"))
            raise error(message)
        return hidden, pending

    def _bind_caches(self, kv_caches: Sequence[KVCache], meta: AttentionMetadata) -> None:
        """Point the layer structs at `kv_caches`, checked first unless they are the very tensors of the
        last call (the engine passes the same cache tensors every step, so they are checked once)."""
        tensors = tuple(tensor for pair in kv_caches for tensor in pair)
        bound = self._bound
        if len(bound) != len(tensors) or any(old is not new for old, new in zip(bound, tensors, strict=True)):
            self._check_caches(kv_caches)  # raises before any struct changes
            for struct, (keys, values) in zip(self._structs, kv_caches, strict=True):
                struct.k_cache, struct.v_cache = keys.data_ptr(), values.data_ptr()
            self._bound = tensors
        first = kv_caches[0][0]
        if meta.max_block_id >= first.shape[0] or first.shape[3] != meta.block_size:
            raise ValueError(
                f"attention metadata (block size {meta.block_size}, block ids up to {meta.max_block_id}) "
                f"does not fit a cache of {first.shape[0]} blocks of {first.shape[3]}"
            )

    def _check_caches(self, kv_caches: Sequence[KVCache]) -> None:
        """The C code trusts its pointers: every layer's cache of one format (fp32, bf16 or q8_0) and the
        first's shape, made for the model's heads."""
        first = kv_caches[0][0]
        spec = self.spec
        if first.shape[1] != spec.num_kv_heads or cache_head_dim(first) != spec.head_dim:
            raise ValueError("fused decoder: the KV cache does not match the model's heads")
        for keys, values in kv_caches:
            if keys.shape != first.shape or keys.dtype != first.dtype:
                raise ValueError("fused decoder: every layer's cache must be of one format and shape")
            try:
                check_caches(keys, values)
            except ValueError as error:
                raise ValueError(f"fused decoder: {error}") from None

    def _step(
        self,
        tokens: int,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        rotary: RotaryTable,
        keys: torch.Tensor,
        flags: int,
    ) -> tuple[_Step, list[torch.Tensor]]:
        """The step struct and the tensors it points to (the inputs as int64, one scratch allocation)."""
        spec, dtype = self.spec, self.dtype
        heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        index = [t.to(torch.int64).contiguous() for t in (positions, meta.write_blocks, meta.write_offsets,
                 meta.block_ids, meta.row_table, meta.row_keys)]  # fmt: skip
        sizes = [-(-tokens * width // 64) * 64 for width in self._row_bytes]  # each starts 64-byte aligned
        scratch = torch.empty(sum(sizes) + 64, dtype=torch.uint8)
        base = -(-scratch.data_ptr() // 64) * 64
        normed, qkv, att, delta, gate_up, act, q32, att32 = itertools.accumulate(sizes[:-1], initial=base)
        step = _Step(
            tokens, spec.hidden_size, heads, kv_heads, dim, spec.intermediate_size, spec.rms_norm_eps,
            dim**-0.5, int(dtype == torch.bfloat16), flags, cache_code(keys), index[0].data_ptr(),
            rotary.cos.data_ptr(), rotary.sin.data_ptr(), rotary.cos.shape[0],
            *(t.data_ptr() for t in index[1:]), meta.block_ids.shape[0], keys.shape[0], keys.shape[3], normed,
            qkv, q32, att32, att, delta, gate_up, act, self._phase_pointer(),
            self._silu_table.data_ptr(),
        )  # fmt: skip
        return step, [*index, scratch]


    def _phase_pointer(self) -> int | None:
        """The address of `phase_seconds` for the C code, None when not profiling."""
        seconds = self.phase_seconds
        if seconds is None:
            return None
        if seconds.dtype != torch.float64 or seconds.shape != (len(PHASES),) or not seconds.is_contiguous():
            raise ValueError(f"fused decoder: phase_seconds must be contiguous float64 [{len(PHASES)}]")
        return seconds.data_ptr()


@functools.cache
def _library(kernels: NativeKernels) -> ctypes.CDLL:
    """The kernels' library with detinf_decoder_layers' signature declared (once per build)."""
    library = kernels.library
    library.detinf_decoder_layers.restype = ctypes.c_int
    library.detinf_decoder_layers.argtypes = [_P, _I64, _P, _P, _P, ctypes.c_int]
    return library
