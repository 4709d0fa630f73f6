"""Shared fixtures: tiny random models built once per test session (no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Set before torch loads libgomp (the kernels share its pool). With one pytest-xdist worker per CPU,
    # each worker's OpenMP threads would spin on the CPUs while they wait, taking the time the other
    # worker's threads need; passive waiting changes timing only, never a bit.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest

from tests.tiny_models import TinyModel, build_hf_model, write_gguf


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """Tiny random Llama HF directory (tied embeddings, BOS added, ChatML template)."""
    return build_hf_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_llama32_dir(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """Tiny random Llama with 2 query heads on 1 KV head of head_dim 32: one q8_0 KV group per 32 values."""
    return build_hf_model(tmp_path_factory.mktemp("tiny-llama32"), "llama", heads=(2, 1, 32))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """Tiny random Qwen2 HF directory (q/k/v biases, untied lm_head)."""
    return build_hf_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """Tiny random Qwen3 HF directory (q/k norms, tied embeddings)."""
    return build_hf_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_llama_gguf(tiny_llama_dir: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """The tiny Llama written as an F32 GGUF file (q/k permuted like llama.cpp's converter)."""
    return write_gguf(tiny_llama_dir, tmp_path_factory.mktemp("tiny-gguf") / "tiny-llama.F32.gguf")


@pytest.fixture(scope="session")
def tiny_llama_gguf_q8(tiny_llama_dir: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """The tiny Llama as a Q8_0 GGUF file (2-D weights quantised, norms F32)."""
    path = tmp_path_factory.mktemp("tiny-gguf-q8") / "tiny-llama.Q8_0.gguf"
    return write_gguf(tiny_llama_dir, path, quant="Q8_0")


@pytest.fixture(scope="session")
def gguf_repo_dir(
    tiny_llama_gguf: TinyModel, tiny_llama_gguf_q8: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A directory laid out like a ``*-GGUF`` Hugging Face repository: the tiny Llama as two GGUF files,
    one per quantization (``tiny-llama-f32.gguf``, ``tiny-llama-q8_0.gguf``), a README, no config.json.
    Shared by the session: copy it before changing it."""
    directory = tmp_path_factory.mktemp("tiny-llama-GGUF")
    (directory / "tiny-llama-f32.gguf").write_bytes(tiny_llama_gguf.path.read_bytes())
    (directory / "tiny-llama-q8_0.gguf").write_bytes(tiny_llama_gguf_q8.path.read_bytes())
    (directory / "README.md").write_text("# tiny-llama-GGUF\n\nOne GGUF file per quantization.\n")
    return directory


@pytest.fixture(scope="session")
def tiny_q4_k_m_gguf(tiny_llama_dir: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama GGUF mixing formats like a Q4_K_M file (Q4_K, Q6_K, Q5_K, Q8_0, F32)."""
    from tests.quant_models import write_random_gguf

    return write_random_gguf(tiny_llama_dir, tmp_path_factory.mktemp("tiny-q4km") / "tiny-mixed.Q4_K_M.gguf")


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """Tiny random Qwen3-MoE HF directory (8 experts, top-3, normalized top-k, q/k norms, tied)."""
    from tests.moe_models import build_moe_hf

    return build_moe_hf(tmp_path_factory.mktemp("tiny-qwen3-moe"), "qwen3_moe")


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """Tiny random Mixtral HF directory (4 experts, top-2; block_sparse_moe names on disk)."""
    from tests.moe_models import build_moe_hf

    return build_moe_hf(tmp_path_factory.mktemp("tiny-mixtral"), "mixtral")


@pytest.fixture(scope="session")
def tiny_qwen2_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """Tiny random Qwen2-MoE HF directory (4 experts, top-2, a sigmoid-gated shared expert, q/k/v bias)."""
    from tests.moe_models import build_moe_hf

    return build_moe_hf(tmp_path_factory.mktemp("tiny-qwen2-moe"), "qwen2_moe")


@pytest.fixture(scope="session")
def tiny_spm_gguf(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """A tiny random llama GGUF whose vocabulary is SentencePiece ("llama"), trained locally (byte
    fallback, dummy prefix, <start_of_turn>/<end_of_turn> control tokens, a Gemma-style template)."""
    from tests.spm_models import train_spm, write_spm_gguf

    directory = tmp_path_factory.mktemp("tiny-spm")
    return write_spm_gguf(directory / "tiny-spm.gguf", train_spm(directory))
