"""The compiled kernels (ops/csrc/*.c: attention, RMSNorm, silu_mul, rotary + KV write, the bf16, fp32
and quantized GEMMs, the sampler's row ops and the rotary tables): the loaded library, its C signatures
and the Python wrappers that check their inputs. How the library is built and cached, and why the build
cannot change bits: ops/native_build.py.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deterministic_inference.ops.kv_format import Q8_DTYPE, Q8_GROUP, cache_code, cache_head_dim, cache_shapes
from deterministic_inference.ops.native_build import build, isa_flags

SILU_TABLE_ENTRIES = 65537  # rowwise.c's: one per bf16 value, and one so a gather at the last stays inside


@dataclass(frozen=True)
class NativeKernels:
    """A loaded build of the kernels (attention, the row-wise ops and the bf16 GEMM)."""

    library: ctypes.CDLL
    path: Path
    digest: str  # sha256 of source + flags + compiler version (first 16 hex digits)
    # rowwise.c's detinf_silu_table: silu of every bf16 gate, as bf16 bits [SILU_TABLE_ENTRIES] (built at
    # load, never written after)
    silu_table: torch.Tensor = field(compare=False)

    def attention(
        self,
        q: torch.Tensor,  # [T, H, D] fp32 contiguous
        k_cache: torch.Tensor,  # [num_blocks, KVH, D, block] fp32, bf16 or q8_0 (int8), keys transposed
        v_cache: torch.Tensor,  # [num_blocks, KVH, block, D] same dtype (ops/kv_format.py: q8_0 layouts)
        block_ids: torch.Tensor,  # [K] int64: block tables of the sequences, one after another
        row_table: torch.Tensor,  # [T] int64: where token t's block table starts in `block_ids`
        row_keys: torch.Tensor,  # [T] int64: how many keys token t sees (its position + 1)
        scale: float,
        out: torch.Tensor,  # [T, H, D] fp32, rows [first, end) written
        rows: tuple[int, int] | None = None,  # compute only token rows [first, end); default all
        tile: int = 0,  # query tokens of a sequence computed together (1..8); 0 = the kernel's choice
        row_first: torch.Tensor | None = None,  # [T] int64: first key each token sees (sliding window)
        softcap: float = 0.0,  # > 0: scores -> tanh(s / softcap) * softcap before the softmax (Gemma 2)
    ) -> None:
        """Causal attention of each row over its own keys (row_first[t]..row_keys[t]-1 under a sliding
        window). Invariant by construction (see the C file): the row range and the tile size change speed
        only."""
        index = (
            (block_ids, row_table, row_keys)
            if row_first is None
            else (block_ids, row_table, row_keys, row_first)
        )
        _check_inputs(q, k_cache, v_cache, out, index)
        first, end = rows if rows is not None else (0, q.shape[0])
        if (
            not 0 <= tile <= 8
            or not 0 <= first <= end <= q.shape[0]
            or row_table.shape[0] != q.shape[0]
            or row_keys.shape[0] != q.shape[0]
            or (row_first is not None and row_first.shape[0] != q.shape[0])
        ):
            raise ValueError("attention kernel: tile, row range or per-row tensors do not match q")
        status = self.library.detinf_attention_window(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), cache_code(k_cache),
            block_ids.data_ptr(), block_ids.shape[0], row_table.data_ptr(), row_keys.data_ptr(),
            None if row_first is None else row_first.data_ptr(), first, end,
            q.shape[1], k_cache.shape[1], q.shape[2], k_cache.shape[3], k_cache.shape[0], scale, softcap,
            out.data_ptr(), tile,
        )  # fmt: skip
        if status == 2:
            raise ValueError("attention kernel: a row sees no key or its block table is out of range")
        if status != 0:
            raise MemoryError("attention kernel could not allocate its workspace")

    def add_rms_norm(
        self,
        hidden: torch.Tensor,  # [M, W] model dtype, updated in place when delta is given
        delta: torch.Tensor | None,  # [M, W] model dtype: the residual branch to add first
        weight: torch.Tensor,  # [W] model dtype
        eps: float,
    ) -> torch.Tensor:
        """(hidden += delta), then RMSNorm of each row -> [M, W] model dtype (HF Llama's formula).

        Why invariant: each row's sum of squares runs in a fixed lane order over that row only."""
        tensors = (hidden, weight) if delta is None else (hidden, weight, delta)
        _check_activations(tensors, hidden.dtype)
        if (
            hidden.dim() != 2
            or weight.shape != (hidden.shape[1],)
            or (delta is not None and delta.shape != hidden.shape)
        ):
            raise ValueError("add_rms_norm: hidden [M, W], delta [M, W] and weight [W] expected")
        out = torch.empty_like(hidden)
        self.library.detinf_add_rms_norm(
            hidden.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), out.data_ptr(),
            hidden.shape[0], hidden.shape[1], eps, int(hidden.dtype == torch.bfloat16),
        )  # fmt: skip
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [M, 2I] (gate then up) -> silu(gate) * up [M, I], elementwise in fp32, model dtype out
        (bf16: silu(gate) read from `silu_table`, the bits of computing it)."""
        _check_activations((gate_up,), gate_up.dtype)
        if gate_up.dim() != 2 or gate_up.shape[1] % 2:
            raise ValueError("silu_mul: gate_up must be [M, 2 * intermediate]")
        out = torch.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype)
        self.library.detinf_silu_mul(
            gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1],
            int(gate_up.dtype == torch.bfloat16), self.silu_table.data_ptr(),
        )  # fmt: skip
        return out

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [M, 2I] (gate then up) -> gelu_tanh(gate) * up [M, I] (GeGLU), elementwise in fp32 with
        the kernels' own tanh, model dtype out."""
        _check_activations((gate_up,), gate_up.dtype)
        if gate_up.dim() != 2 or gate_up.shape[1] % 2:
            raise ValueError("gelu_tanh_mul: gate_up must be [M, 2 * intermediate]")
        out = torch.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype)
        bf16 = int(gate_up.dtype == torch.bfloat16)
        self.library.detinf_gelu_tanh_mul(
            gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1], bf16
        )
        return out

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        """tanh(x / cap) * cap of fp32 `x` (any shape) -> a new fp32 tensor; elementwise."""
        if x.dtype != torch.float32:
            raise ValueError("softcap: x must be fp32")
        out = x.contiguous().clone()
        self.library.detinf_softcap(out.data_ptr(), out.numel(), cap)
        return out

    def rotary_write_kv(
        self,
        qkv: torch.Tensor,  # [T, (H + 2 KVH) * D] model dtype
        positions: torch.Tensor,  # [T] int64
        cos: torch.Tensor,  # [P, D] fp32
        sin: torch.Tensor,  # [P, D] fp32
        write_blocks: torch.Tensor,  # [T] int64
        write_offsets: torch.Tensor,  # [T] int64
        k_cache: torch.Tensor,  # [blocks, KVH, D, block] fp32, bf16 or q8_0 (ops/kv_format.py)
        v_cache: torch.Tensor,  # [blocks, KVH, block, D] the same format
        heads: int,
    ) -> torch.Tensor:
        """Rotate q and k by position (rotate-half, HF's rounding), write k and v to their cache slots
        (as the model dtype rounds them; then rounded to a bf16 cache, or quantized per 32 values into
        a q8_0 one); -> rotated q [T, H, D] fp32. Elementwise per token: invariant by construction."""
        num_blocks, kv_heads, _, block = k_cache.shape
        dim = cache_head_dim(k_cache)
        _check_activations((qkv,), qkv.dtype)
        check_caches(k_cache, v_cache)
        _check_indices((positions, write_blocks, write_offsets))
        tokens = qkv.shape[0]
        if qkv.dim() != 2 or qkv.shape[1] != (heads + 2 * kv_heads) * dim or dim > 1024 or dim % 2:
            raise ValueError("rotary_write_kv: qkv width does not match the heads and the cache")
        if any(index.shape != (tokens,) for index in (positions, write_blocks, write_offsets)):
            raise ValueError("rotary_write_kv: positions, blocks and offsets need one entry per token")
        tables_ok = cos.dtype == sin.dtype == torch.float32 and cos.shape == sin.shape
        if not (
            tables_ok
            and cos.dim() == 2
            and cos.shape[1] == dim
            and cos.is_contiguous()
            and sin.is_contiguous()
        ):
            raise ValueError(
                "rotary_write_kv: cos and sin must be contiguous fp32 [positions, head_dim] tables"
            )
        q_out = torch.empty((tokens, heads, dim), dtype=torch.float32)
        status = self.library.detinf_rotary_write_kv(
            qkv.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), write_blocks.data_ptr(),
            write_offsets.data_ptr(), q_out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tokens, heads,
            kv_heads, dim, block, num_blocks, cos.shape[0], int(qkv.dtype == torch.bfloat16),
            cache_code(k_cache),
        )  # fmt: skip
        if status != 0:
            raise ValueError("rotary_write_kv: a position, cache block or slot offset is out of range")
        return q_out

    def pack_bf16(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [N, K] bf16 -> the GEMM's packed layout [ceil(N/16) * ceil(K/2) * 32] bf16 (zero padded)."""
        if weight.dtype != torch.bfloat16 or weight.dim() != 2 or not weight.is_contiguous():
            raise ValueError("pack_bf16: the weight must be a contiguous bf16 [out, in] matrix")
        n, k = weight.shape
        packed = torch.empty(packed_numel(n, k), dtype=torch.bfloat16)
        self.library.detinf_pack_bf16(weight.data_ptr(), n, k, packed.data_ptr())
        return packed

    def gemm_bf16(
        self,
        x: torch.Tensor,  # [M, K] bf16 contiguous
        packed: torch.Tensor,  # from pack_bf16 of a [N, K] weight
        out_features: int,  # N
        bias: torch.Tensor | None,  # [N] fp32 contiguous
        out_dtype: torch.dtype,  # torch.bfloat16 or torch.float32
        native: bool = False,  # True: the AMX-BF16 tiles of native numerics (gemm_amx.h)
    ) -> torch.Tensor:
        """x W^T (+ b) -> [M, N]. Why invariant: each output is a fixed-order fp32 sum over its own row
        and column (see gemm.c), whatever M, the row's position or the thread count. With `native`, the
        AMX-BF16 tiles: every row through the same tile instructions, K in one fixed order, threads
        splitting N only (gemm_amx.h), so the same invariance holds on one CPU class, whose bits they are.
        RuntimeError when native and this process cannot run them (`native_gemm_missing`)."""
        _check_activations((x,), torch.bfloat16)
        rows, k = x.shape if x.dim() == 2 else (0, -1)
        if x.dim() != 2 or packed.dtype != torch.bfloat16 or packed.numel() != packed_numel(out_features, k):
            raise ValueError("gemm_bf16: x must be [M, K] and the packed weight must be [N, K] packed")
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (out_features,)):
            raise ValueError("gemm_bf16: the bias must be fp32 [N]")
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError("gemm_bf16: the output dtype must be bf16 or fp32")
        out = torch.empty((rows, out_features), dtype=out_dtype)
        if not rows:
            return out
        gemm = self.library.detinf_gemm_bf16_amx if native else self.library.detinf_gemm_bf16
        status = gemm(
            x.data_ptr(), rows, k, packed.data_ptr(), out_features,
            None if bias is None else bias.contiguous().data_ptr(), out.data_ptr(),
            int(out_dtype == torch.bfloat16),
        )  # fmt: skip
        if native and status:
            raise (MemoryError if status == 3 else RuntimeError)(
                f"gemm_bf16 (native numerics): {_AMX_STATUS.get(status, 'could not allocate its buffers')}"
            )
        return out

    def native_gemm_missing(self) -> str | None:
        """None when this process can run the AMX-BF16 GEMM of `--numerics native`, else what is missing
        (a phrase naming the CPU feature, the build or the OS permission)."""
        return _AMX_STATUS.get(self.library.detinf_gemm_bf16_amx_status())

    def gemm_bf16_path(self) -> str:
        """The path this build's bf16 GEMM runs: "fma" (fp32 FMAs, Intel AVX-512), "vdpbf16ps" (AMD) or
        "portable" (the fmaf loop). The same bits on every path (ops/csrc/gemm.c)."""
        return ("portable", "vdpbf16ps", "fma")[self.library.detinf_gemm_bf16_path()]

    def exp(self, x: float) -> float:
        """The kernel's exp for x in [-87, 0] (tests compare it with a float64 reference)."""
        return float(self.library.detinf_exp_nonpositive(x))


# detinf_gemm_bf16_amx_status's codes -> what is missing
_AMX_STATUS = {
    1: "this CPU has no AMX-BF16 tiles (lscpu flags amx_tile, amx_bf16), or the kernels were built for "
    "another -march (unset DETINF_KERNEL_MARCH)",
    2: "the OS did not grant this process the AMX tile state (Linux >= 5.16, arch_prctl ARCH_REQ_XCOMP_PERM)",
}


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    index_tensors: tuple[torch.Tensor, ...],
) -> None:
    """The C code trusts its pointers: refuse anything it would misread."""
    if q.dtype != torch.float32 or out.dtype != torch.float32 or q.shape != out.shape:
        raise ValueError("attention kernel: q and out must be fp32 tensors of the same shape")
    check_caches(k_cache, v_cache)
    if cache_head_dim(k_cache) != q.shape[2] or q.shape[1] % k_cache.shape[1]:
        raise ValueError("attention kernel: cache shapes do not match q")
    for tensor in (q, out):
        if not tensor.is_contiguous():
            raise ValueError("attention kernel: every tensor must be contiguous")
    _check_indices(index_tensors)


def check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Both caches contiguous, of one format (fp32, bf16 or q8_0) and of matching layouts."""
    if v_cache.dtype != k_cache.dtype:
        raise ValueError("KV cache: keys and values must have one format")
    cache_code(k_cache)  # raises for a dtype no kernel reads
    num_blocks, kv_heads, _, block = k_cache.shape
    dim = cache_head_dim(k_cache)
    if k_cache.dtype == Q8_DTYPE and dim % Q8_GROUP:
        raise ValueError(f"KV cache: q8_0 needs head_dim a multiple of {Q8_GROUP}, not {dim}")
    if (k_cache.shape, v_cache.shape) != cache_shapes(num_blocks, block, kv_heads, dim, k_cache.dtype):
        raise ValueError("KV cache: the value cache does not match the key cache")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("KV cache: the caches must be contiguous")


def packed_numel(out_features: int, in_features: int) -> int:
    """Elements of a packed [N, K] bf16 weight: N rounded up to 16 times K rounded up to 2."""
    return -(-out_features // 16) * 16 * (-(-in_features // 2) * 2)


def _check_activations(tensors: tuple[torch.Tensor, ...], dtype: torch.dtype) -> None:
    """The C code reads raw memory: contiguous tensors of one model dtype (fp32 or bf16) only."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"native kernels take fp32 or bf16 activations, not {dtype}")
    for tensor in tensors:
        if tensor.dtype != dtype or not tensor.is_contiguous():
            raise ValueError(f"native kernels: every tensor must be contiguous {dtype}")


def _check_indices(tensors: tuple[torch.Tensor, ...]) -> None:
    for tensor in tensors:
        if tensor.dtype != torch.int64 or not tensor.is_contiguous():
            raise ValueError("native kernels: index tensors must be contiguous int64")


def load(path: Path) -> NativeKernels:
    """Load a built library and declare its C signatures."""
    library = ctypes.CDLL(str(path))
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    library.detinf_attention.restype = ctypes.c_int
    library.detinf_attention.argtypes = [
        pointer, pointer, pointer, ctypes.c_int, pointer, i64, pointer, pointer,
        i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, pointer, i64,
    ]  # fmt: skip
    library.detinf_attention_window.restype = ctypes.c_int
    library.detinf_attention_window.argtypes = [
        pointer, pointer, pointer, ctypes.c_int, pointer, i64, pointer, pointer, pointer,
        i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_float, pointer, i64,
    ]  # fmt: skip
    library.detinf_add_rms_norm.restype = None
    library.detinf_add_rms_norm.argtypes = [
        pointer,
        pointer,
        pointer,
        pointer,
        i64,
        i64,
        ctypes.c_float,
        ctypes.c_int,
    ]
    library.detinf_silu_mul.restype = None
    library.detinf_silu_mul.argtypes = [pointer, pointer, i64, i64, ctypes.c_int, pointer]
    library.detinf_silu_table.restype = None
    library.detinf_silu_table.argtypes = [pointer]
    library.detinf_gelu_tanh_mul.restype = None
    library.detinf_gelu_tanh_mul.argtypes = [pointer, pointer, i64, i64, ctypes.c_int]
    library.detinf_softcap.restype = None
    library.detinf_softcap.argtypes = [pointer, i64, ctypes.c_float]
    library.detinf_rotary_write_kv.restype = ctypes.c_int
    library.detinf_rotary_write_kv.argtypes = [pointer] * 9 + [i64] * 7 + [ctypes.c_int, ctypes.c_int]
    library.detinf_pack_bf16.restype = None
    library.detinf_pack_bf16.argtypes = [pointer, i64, i64, pointer]
    library.detinf_gemm_bf16.restype = None
    library.detinf_gemm_bf16.argtypes = [pointer, i64, i64, pointer, i64, pointer, pointer, ctypes.c_int]
    library.detinf_gemm_bf16_amx.restype = ctypes.c_int
    library.detinf_gemm_bf16_amx.argtypes = library.detinf_gemm_bf16.argtypes
    library.detinf_gemm_bf16_amx_status.restype = ctypes.c_int
    library.detinf_gemm_bf16_amx_status.argtypes = []
    library.detinf_gemm_bf16_path.restype = ctypes.c_int
    library.detinf_gemm_bf16_path.argtypes = []
    library.detinf_exp_nonpositive.restype = ctypes.c_float
    library.detinf_exp_nonpositive.argtypes = [ctypes.c_float]
    _declare_portable(library)
    silu_table = torch.empty(SILU_TABLE_ENTRIES, dtype=torch.int16)
    library.detinf_silu_table(silu_table.data_ptr())
    return NativeKernels(library, path, path.stem.removeprefix("attention-"), silu_table)


def _declare_portable(library: ctypes.CDLL) -> None:
    """C signatures of the portable-numerics kernels (sampling.c, rotary_tables.c, gemm_f32.c)."""
    pointer, i64, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
    signatures = {
        "detinf_rows": (None, [pointer, pointer, i64, i64, ctypes.c_int]),
        "detinf_greedy_rows": (None, [pointer, i64, i64, pointer, pointer, pointer]),
        "detinf_inverse_frequencies": (None, [f64, i64, pointer]),
        "detinf_rotary_out_of_range": (ctypes.c_int, [pointer, i64, i64]),
        "detinf_rotary_tables": (ctypes.c_int, [pointer, i64, i64, pointer, pointer]),
        "detinf_pack_f32": (None, [pointer, i64, i64, pointer]),
        "detinf_gemm_f32": (None, [pointer, i64, i64, pointer, i64, pointer, pointer]),
        "detinf_test_expf": (ctypes.c_float, [ctypes.c_float]),
        "detinf_test_exp": (f64, [f64]),
        "detinf_test_log": (f64, [f64]),
        "detinf_test_sincos": (f64, [f64, ctypes.c_int]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(library, name)
        function.restype, function.argtypes = restype, argtypes


@functools.cache
def native_kernels() -> NativeKernels:
    """The kernel for this process, built once (a read-only resource, not mutable state) for the
    -march that $DETINF_KERNEL_MARCH names (the build's cache key includes it).

    Raises NativeBuildError when it cannot be built."""
    return load(build(isa_flags()))
