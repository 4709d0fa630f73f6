"""The decode fast path (ops/fused.py, csrc/decoder.c) gives the per-op path's bits.

Three steps of a mixed batch (two prefills, then a decode row beside a 4-token chunk, then a decode row
alone) run through `DecoderModel.forward` with the fused path and with the per-op path, from the same
empty caches: the final hidden states of every step and the whole KV caches afterwards must be equal bit
for bit. Models: a tiny Q4_K_M-style mixed GGUF (bf16 and fp32), a tiny Qwen2 with q/k/v biases on the
bf16 GEMM, and the embedded default model (Q4_1 layers). Negative control: the fused path with the
quantized GEMM's activation scales taken over the whole batch (a test hook) must be detected. Models the
fast path does not serve (Qwen3's q/k norms; fp32 dense weights on oneDNN) take the per-op path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.setup import build_model
from deterministic_inference.model.decoder import DecoderModel
from deterministic_inference.model.loader import load_model
from deterministic_inference.ops.attention import AttentionMetadata, new_kv_cache
from deterministic_inference.ops.fused import PHASES
from deterministic_inference.ops.native import NativeKernels
from deterministic_inference.ops.quant import TEST_BATCH_SCALE
from tests.tiny_models import TinyModel

BLOCK = 16
# per step: (start position, tokens, block table) of each sequence
STEPS = (
    [(0, 13, [0, 1]), (0, 5, [2, 3])],
    [(13, 1, [0, 1]), (5, 4, [2, 3])],
    [(14, 1, [0, 1])],
)

Run = tuple[list[torch.Tensor], list[torch.Tensor]]


def bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.int8:  # a q8_0 cache: its bytes
        return t.clone()
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32).clone()


def run_steps(
    model: DecoderModel, fused: bool, flags: int = 0, cache_dtype: torch.dtype | None = None
) -> Run:
    """(final hidden bits of each step, bits of every cache tensor after the last step); the caches in
    `cache_dtype` (torch.int8: q8_0), default the model dtype."""
    spec, dtype = model.spec, model.numerics.dtype if cache_dtype is None else cache_dtype
    caches = [new_kv_cache(8, BLOCK, spec.num_kv_heads, spec.head_dim, dtype) for _ in range(spec.num_layers)]
    generator = torch.Generator().manual_seed(0)
    hidden_bits = []
    for sequences in STEPS:
        count = sum(tokens for _, tokens, _ in sequences)
        ids = torch.randint(0, spec.vocab_size, (count,), generator=generator)
        positions = torch.tensor([start + i for start, tokens, _ in sequences for i in range(tokens)])
        meta = AttentionMetadata.build(sequences, BLOCK)
        if flags:  # the forward's fused branch, with the GEMM's test hook
            assert model.fused is not None
            hidden, pending = model.fused(
                model.embed(ids), positions, meta, caches, model.rotary, flags=flags
            )
            hidden, _ = model.ops.add_rms_norm(hidden, pending, model.final_norm, spec.rms_norm_eps)
        else:
            hidden = model.forward(ids, positions, meta, caches, fused=fused)
        hidden_bits.append(bits(hidden))
    return hidden_bits, [bits(t) for cache in caches for t in cache]


def same(a: Run, b: Run) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1], strict=True))


def model_of(path: Path | None, dtype: str) -> DecoderModel:
    return build_model(load_model(None if path is None else str(path)), EngineConfig(), dtype, 128)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fused_equals_per_op_on_mixed_quantized_formats(tiny_q4_k_m_gguf: Path, dtype: str) -> None:
    model = model_of(tiny_q4_k_m_gguf, dtype)
    assert model.fused is not None
    per_op = run_steps(model, fused=False)
    assert same(run_steps(model, fused=True), per_op)
    # negative control: activation block scales taken over the whole batch (a test hook) are seen
    assert not same(run_steps(model, fused=True, flags=TEST_BATCH_SCALE), per_op)


def test_fused_equals_per_op_on_the_bf16_gemm_with_biases(tiny_qwen2_dir: TinyModel) -> None:
    model = model_of(tiny_qwen2_dir.path, "bfloat16")
    assert model.fused is not None and model.layers[0].qkv.backend == "native"
    assert same(run_steps(model, fused=True), run_steps(model, fused=False))


def test_fused_runs_the_native_gemm_under_native_numerics(amx: NativeKernels) -> None:
    """`--numerics native`: the fused path calls the per-op path's AMX-BF16 GEMM (the same bits), and
    those differ from the portable GEMM's, so a fused path that kept the portable GEMM would be seen. The
    default model with every weight dequantised to bf16 (--quantization none): every linear on the GEMM."""
    loaded = load_model(None, "none")
    native = build_model(loaded, EngineConfig(quantization="none", numerics_mode="native"), "bfloat16", 128)
    assert native.fused is not None and native.layers[0].qkv.native_gemm
    per_op = run_steps(native, fused=False)
    assert same(run_steps(native, fused=True), per_op)
    portable = build_model(loaded, EngineConfig(quantization="none"), "bfloat16", 128)
    assert not same(run_steps(portable, fused=True), per_op)


def test_native_numerics_read_a_quantized_file_in_place_with_its_dequantised_bits(
    amx: NativeKernels, tiny_q4_k_m_gguf: Path
) -> None:
    """`--numerics native` on a quantized file (mixed K formats): the linears keep the blocks and dequantise
    them into the AMX-BF16 tiles; the fused path calls that GEMM (the per-op bits), and the bits are those
    of the same file loaded with `--quantization none` (every weight dequantised to bf16 at load) on the
    same tiles. The portable quantized GEMM's bits differ (so the test sees which GEMM ran)."""
    path = str(tiny_q4_k_m_gguf)
    stored = build_model(load_model(path), EngineConfig(numerics_mode="native"), "bfloat16", 128)
    assert stored.fused is not None and stored.layers[0].qkv.quant_tiles is not None
    per_op = run_steps(stored, fused=False)
    assert same(run_steps(stored, fused=True), per_op)
    config = EngineConfig(quantization="none", numerics_mode="native")
    dequantised = build_model(load_model(path, "none"), config, "bfloat16", 128)
    assert dequantised.layers[0].qkv.quant_tiles is None and dequantised.layers[0].qkv.native_gemm
    assert same(run_steps(dequantised, fused=True), per_op)
    assert not same(run_steps(model_of(tiny_q4_k_m_gguf, "bfloat16"), fused=True), per_op)


def test_models_the_fast_path_does_not_serve_take_the_per_op_path(
    tiny_qwen3_dir: TinyModel, tiny_qwen2_dir: TinyModel
) -> None:
    assert model_of(tiny_qwen3_dir.path, "bfloat16").fused is None  # per-head q/k norms
    assert model_of(tiny_qwen2_dir.path, "float32").fused is None  # fp32 dense weights: oneDNN


def test_fused_rejects_a_cache_of_another_shape(tiny_q4_k_m_gguf: Path) -> None:
    model = model_of(tiny_q4_k_m_gguf, "bfloat16")
    spec = model.spec
    assert model.fused is not None
    caches = [new_kv_cache(2, BLOCK, spec.num_kv_heads, spec.head_dim, torch.bfloat16) for _ in model.layers]
    meta = AttentionMetadata.build([(0, 3, [5])], BLOCK)  # block 5 of a 2-block cache
    hidden = model.embed(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="does not fit a cache of 2 blocks"):
        model.fused(hidden, torch.arange(3), meta, caches, model.rotary)


def test_fused_checks_every_new_set_of_caches(tiny_q4_k_m_gguf: Path) -> None:
    """The caches are checked once while the same tensors come back; any other tensor is checked again."""
    model = model_of(tiny_q4_k_m_gguf, "bfloat16")
    spec = model.spec
    assert model.fused is not None
    caches = [new_kv_cache(2, BLOCK, spec.num_kv_heads, spec.head_dim, torch.bfloat16) for _ in model.layers]
    meta = AttentionMetadata.build([(0, 3, [1])], BLOCK)
    for _ in range(2):
        model.fused(model.embed(torch.tensor([1, 2, 3])), torch.arange(3), meta, caches, model.rotary)
    wrong = [*caches[:-1], new_kv_cache(2, BLOCK, spec.num_kv_heads, spec.head_dim, torch.float32)]
    with pytest.raises(ValueError, match="every layer's cache must be"):
        model.fused(model.embed(torch.tensor([1, 2, 3])), torch.arange(3), meta, wrong, model.rotary)
    late = AttentionMetadata.build([(0, 3, [5])], BLOCK)  # the step's metadata is checked at every call
    with pytest.raises(ValueError, match="does not fit a cache of 2 blocks"):
        model.fused(model.embed(torch.tensor([1, 2, 3])), torch.arange(3), late, caches, model.rotary)


@pytest.mark.slow
def test_fused_equals_per_op_on_the_default_model() -> None:
    model = model_of(None, "bfloat16")
    assert model.fused is not None
    assert same(run_steps(model, fused=True), run_steps(model, fused=False))


def test_phi3_fused_projections_go_through_the_fused_path(tmp_path: Path) -> None:
    """Phi-3 without a window: its stored-fused qkv / gate_up (Q8_0) are single parts of the same GEMMs, so
    the fused decoder serves it, bit for bit the per-op path; with a window it takes the per-op path."""
    from tests.arch_models import build_arch_hf, write_arch_gguf

    tiny = build_arch_hf(tmp_path / "phi3", "phi3", window=None)
    model = model_of(write_arch_gguf(tiny, tmp_path / "phi3.Q8_0.gguf", quant="Q8_0"), "bfloat16")
    assert model.fused is not None and model.spec.sliding_window == 0
    assert same(run_steps(model, fused=True), run_steps(model, fused=False))
    windowed = build_arch_hf(tmp_path / "phi3w", "phi3")
    assert (
        model_of(write_arch_gguf(windowed, tmp_path / "phi3w.Q8_0.gguf", quant="Q8_0"), "bfloat16").fused
        is None
    )


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fused_equals_per_op_on_a_q8_kv_cache_of_the_default_model(dtype: str) -> None:
    """The q8_0 cache (SmolLM2: head_dim 64): the fused path's write and attention give the per-op path's
    cache bytes and hidden bits; the q8_0 run differs from the model-dtype cache's (the option is live)."""
    model = model_of(None, dtype)
    assert model.fused is not None
    per_op = run_steps(model, fused=False, cache_dtype=torch.int8)
    assert same(run_steps(model, fused=True, cache_dtype=torch.int8), per_op)
    model_dtype_cache = run_steps(model, fused=False)
    assert not all(torch.equal(x, y) for x, y in zip(per_op[0], model_dtype_cache[0], strict=True))


def test_timing_the_phases_changes_no_bit(tiny_q4_k_m_gguf: Path) -> None:
    """bench/profile_engine.py's phase timings (FusedDecoder.phase_seconds, csrc/decoder.c PHASE): the
    same bits as an untimed run, every phase timed, and the buffer checked."""
    model = model_of(tiny_q4_k_m_gguf, "bfloat16")
    assert model.fused is not None
    untimed = run_steps(model, fused=True)
    model.fused.phase_seconds = torch.zeros(len(PHASES), dtype=torch.float64)
    try:
        timed = run_steps(model, fused=True)
        seconds = model.fused.phase_seconds.tolist()
    finally:
        model.fused.phase_seconds = None
    assert same(timed, untimed)
    assert all(value > 0.0 for value in seconds), dict(zip(PHASES, seconds, strict=True))
    model.fused.phase_seconds = torch.zeros(len(PHASES), dtype=torch.float32)
    with pytest.raises(ValueError, match="phase_seconds must be contiguous float64"):
        run_steps(model, fused=True)
