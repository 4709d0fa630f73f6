"""Engine construction helpers: dtype choice, model build, KV-cache sizing."""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.fingerprint import hardware_fingerprint
from deterministic_inference.model.llama import DecoderModel, Numerics
from deterministic_inference.model.loader import LoadedModel
from deterministic_inference.model.spec import ModelSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
DEFAULT_KV_CACHE_BYTES = 2 << 30  # KV memory when num_kv_blocks is not set
# glibc mallopt parameters and the values the engine sets (see keep_freed_memory)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD = 32 << 20  # glibc's largest accepted value on 64-bit
_TRIM_THRESHOLD = 1 << 30


def cpu_has_native_bf16() -> bool:
    """True when the CPU advertises bf16 arithmetic (AVX512_BF16 or AMX-BF16), read from the same
    ISA features the hardware fingerprint records."""
    isa = hardware_fingerprint()["isa"]
    return any(isa.get(flag, False) for flag in NATIVE_BF16_FLAGS)


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse instead of returning it to the OS.

    Each step allocates temporaries of a few MB (activations of a 512-token chunk, a logits batch).
    By default glibc serves those with mmap and unmaps them on free, so every step pays page faults on
    fresh pages (measured: ~20% of a prefill step). Raising the mmap and trim thresholds keeps them
    in the heap. Process-wide, like the thread count; changes speed only, never a value. Returns False
    where the C library has no mallopt (not glibc)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mmap_set = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
    return bool(mmap_set) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))


def resolve_dtype(requested: str) -> str:
    """ "auto" -> "bfloat16" on CPUs with native bf16, else "float32"; explicit names pass through."""
    if requested != "auto":
        return requested
    return "bfloat16" if cpu_has_native_bf16() else "float32"


def build_model(
    loaded: LoadedModel, config: EngineConfig, dtype_name: str, max_model_len: int
) -> DecoderModel:
    """The decoder with the configured numerics; weights cast from the loader's fp32."""
    numerics = Numerics(
        dtype=DTYPES[dtype_name],
        batch_invariant=config.batch_invariant,
        tile_rows=config.linear_tile_rows,
    )
    return DecoderModel(loaded.spec, loaded.weights, numerics, max_model_len)


def choose_num_kv_blocks(config: EngineConfig, spec: ModelSpec, max_model_len: int, dtype_name: str) -> int:
    """Configured block count, else as many as fit DEFAULT_KV_CACHE_BYTES, at least one full context."""
    one_context = -(-max_model_len // config.kv_block_size) + 1
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    element_bytes = 2 if dtype_name == "bfloat16" else 4
    per_block = 2 * spec.num_layers * config.kv_block_size * spec.num_kv_heads * spec.head_dim * element_bytes
    return max(one_context, DEFAULT_KV_CACHE_BYTES // per_block)
