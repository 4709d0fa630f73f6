"""Engine construction helpers: dtype choice, model build, KV-cache sizing."""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.kv_memory import kv_block_bytes
from deterministic_inference.errors import ConfigError
from deterministic_inference.fingerprint import hardware_fingerprint
from deterministic_inference.model.decoder import DecoderModel, Numerics
from deterministic_inference.model.loader import LoadedModel
from deterministic_inference.model.quantization import apply_quantization
from deterministic_inference.model_spec import ModelSpec
from deterministic_inference.ops.kv_format import Q8_DTYPE, Q8_GROUP, cache_dtype
from deterministic_inference.ops.native import native_kernels
from deterministic_inference.ops.repack import give_back_superseded

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
DEFAULT_KV_CACHE_BYTES = 2 << 30  # KV pool cap when neither num_kv_blocks nor kv_cache_memory is set
# glibc mallopt parameters and the values the engine sets (see keep_freed_memory)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD = 32 << 20  # glibc's largest accepted value on 64-bit
_TRIM_THRESHOLD = 1 << 30
_START_UP_THRESHOLD = 256 << 10  # both thresholds while the engine starts (see return_freed_memory)


def cpu_has_native_bf16() -> bool:
    """True when the CPU advertises bf16 arithmetic (AVX512_BF16 or AMX-BF16), read from the same
    ISA features the hardware fingerprint records."""
    isa = hardware_fingerprint()["isa"]
    return any(isa.get(flag, False) for flag in NATIVE_BF16_FLAGS)


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse instead of returning it to the OS (for serving).

    Each step allocates temporaries of a few MB (activations of a 512-token chunk, a logits batch).
    By default glibc serves those with mmap and unmaps them on free, so every step pays page faults on
    fresh pages (measured: ~20% of a prefill step). Raising the mmap and trim thresholds keeps them
    in the heap. Process-wide, like the thread count; changes speed only, never a value. Returns False
    where the C library has no mallopt (not glibc)."""
    return _set_malloc_thresholds(_MMAP_THRESHOLD, _TRIM_THRESHOLD)


def return_freed_memory() -> bool:
    """Ask glibc to give freed memory back at once (while the engine starts): every allocation above
    256 KiB gets its own mapping, unmapped when freed, and the heap's free top is trimmed on free.

    The start-up self-check's temporaries then leave nothing resident beside the weights: with the
    serving thresholds its largest ones (the logits of 17 probe rows: 3.3 MB for a 49k vocabulary) stayed
    in the heap until the final trim, on top of the peak. Fixed thresholds also stop glibc's own
    adjustment, which raises the mmap threshold to the size of the first large block freed. Speed only
    (a start-up's few hundred extra page faults), never a value; False where there is no mallopt."""
    return _set_malloc_thresholds(_START_UP_THRESHOLD, _START_UP_THRESHOLD)


def _set_malloc_thresholds(mmap_threshold: int, trim_threshold: int) -> bool:
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mmap_set = mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
    return bool(mmap_set) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))


def release_freed_memory() -> bool:
    """Return the heap's free memory to the OS once (glibc malloc_trim): the load and the start-up
    self-check leave tens of MB of freed temporaries that `keep_freed_memory` would otherwise keep
    resident for the process's life. Speed and values unchanged; False where there is no malloc_trim."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name is not None else None
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))


def resolve_dtype(requested: str, batch_invariant: bool = True) -> str:
    """ "auto" -> "bfloat16" in invariant mode on every CPU: the kernels compute bf16 models with the same
    bits with or without AVX512-BF16 (portable numerics), so the default numerics must not depend on the
    CPU either. With `batch_invariant=False` (plain torch): bf16 on CPUs with native bf16, else fp32.
    Explicit names pass through."""
    if requested != "auto":
        return requested
    if batch_invariant:
        return "bfloat16"
    return "bfloat16" if cpu_has_native_bf16() else "float32"


def model_numerics(config: EngineConfig, dtype_name: str) -> Numerics:
    """The numerics the model is built with (dtype, invariant kernels or plain torch, tile rows, the
    AMX-BF16 GEMM of `--numerics native`)."""
    return Numerics(
        dtype=DTYPES[dtype_name], batch_invariant=config.batch_invariant, tile_rows=config.linear_tile_rows,
        native_gemm=config.numerics_mode == "native",
    )  # fmt: skip


def build_model(
    loaded: LoadedModel, config: EngineConfig, dtype_name: str, max_model_len: int
) -> DecoderModel:
    """The decoder with the configured numerics and weight formats (`--quantization`)."""
    numerics = model_numerics(config, dtype_name)
    if not config.batch_invariant:
        # The sampler's arithmetic runs in the compiled kernels in every mode: without a C compiler,
        # refuse now (NativeBuildError, one line) rather than fail the first sampled token.
        native_kernels()
    weights = apply_quantization(loaded.weights, config.quantization, numerics.dtype)
    model = DecoderModel(loaded.spec, weights, numerics, max_model_len)
    give_back_superseded(weights.values())
    return model


def kv_cache_format(config: EngineConfig, spec: ModelSpec, dtype_name: str) -> torch.dtype:
    """The torch dtype of the KV cache tensors for `--kv-cache-dtype` (torch.int8: q8_0). ConfigError,
    naming the option, when q8_0 cannot store this model's heads (head_dim not a multiple of 32)."""
    dtype = cache_dtype(config.kv_cache_dtype, DTYPES[dtype_name])
    if dtype == Q8_DTYPE and spec.head_dim % Q8_GROUP:
        raise ConfigError(
            f"--kv-cache-dtype q8_0: this model's head_dim {spec.head_dim} is not a multiple of {Q8_GROUP}; "
            "use --kv-cache-dtype auto or bf16"
        )
    return dtype


def choose_num_kv_blocks(config: EngineConfig, spec: ModelSpec, max_model_len: int, dtype_name: str) -> int:
    """The pool's block count: `num_kv_blocks` when set; else as many blocks as fit `kv_cache_memory`
    (ConfigError when not even one does); else as many as fit DEFAULT_KV_CACHE_BYTES, at least one full
    context; blocks sized in the `--kv-cache-dtype` format. The pool is address space: memory becomes
    resident as blocks are used (kv_memory)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_block_bytes(spec, config.kv_block_size, kv_cache_format(config, spec, dtype_name))
    if config.kv_cache_memory is not None:
        if config.kv_cache_memory < per_block:
            raise ConfigError(
                f"kv_cache_memory: {config.kv_cache_memory} bytes hold no KV block of this model "
                f"({per_block} bytes for {config.kv_block_size} tokens); raise it"
            )
        return config.kv_cache_memory // per_block
    one_context = -(-max_model_len // config.kv_block_size) + 1
    return max(one_context, DEFAULT_KV_CACHE_BYTES // per_block)
