"""The families `bench.make_gguf --arch` writes (bench/gguf_families.py): tiny files of each family load
in our engine with the family's features read back (window and window pattern, rope bases, soft-caps,
Gemma's norms and head width, Phi-3's fused projections) and generate; the presets are the published
models' shapes. llama.cpp loading is checked only where llama-cpp-python is installed (never in CI).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.gguf_families import FAMILIES, family, write_family_gguf
from bench.make_gguf import LlamaShape, model_tensors

# TINY shapes: rows of 64 / 128 values (Q8_0's block is 32); head_dim 32 != hidden / heads for Gemma
TINY = {
    "mistral": LlamaShape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, context=256, rope_theta=10000.0,
                          tie_embeddings=False, sliding_window=8),
    "gemma3": LlamaShape(hidden=64, layers=6, heads=4, kv_heads=1, ffn=128, head_dim=32, context=256,
                         rope_theta=1_000_000.0, rms_eps=1e-6, sliding_window=8),
    "gemma2": LlamaShape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, head_dim=32, context=256,
                         rope_theta=10000.0, rms_eps=1e-6, sliding_window=8),
    "phi3": LlamaShape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, context=256, rope_theta=10000.0,
                       tie_embeddings=False, sliding_window=8),
}  # fmt: skip
NEW_FAMILIES = tuple(TINY)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """(family, format) -> a tiny file of that family, F32 and Q8_0, written once for the module."""
    folder = tmp_path_factory.mktemp("families")
    return {
        (name, qtype): write_family_gguf(folder / f"{name}.{qtype}.gguf", name, TINY[name], qtype, seed=3)
        for name in NEW_FAMILIES
        for qtype in ("F32", "Q8_0")
    }


@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_tiny_files_read_back_with_the_family_features(
    tiny_files: dict[tuple[str, str], Path], name: str
) -> None:
    from deterministic_inference.model.gguf_loader import load_gguf

    spec, weights, _, _ = load_gguf(tiny_files[(name, "Q8_0")])
    tiny = TINY[name]
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        64, tiny.layers, 4, tiny.kv_heads, tiny.dim,
    )  # fmt: skip
    assert (spec.sliding_window, spec.rope_theta, spec.rms_norm_eps) == (8, tiny.rope_theta, tiny.rms_eps)
    assert spec.tie_word_embeddings == tiny.tie_embeddings
    expected = {
        "mistral": ("llama", (), 0.0, 0.0, 0.0),
        "gemma3": ("gemma3", (True,) * 5 + (False,), 10000.0, 0.0, 0.0),  # 5 local : 1 global
        "gemma2": ("gemma2", (True, False), 0.0, 50.0, 30.0),
        "phi3": ("phi3", (), 0.0, 0.0, 0.0),
    }[name]
    read = (spec.architecture, spec.window_layers, spec.rope_local_theta, spec.attn_logit_softcapping,
            spec.final_logit_softcapping)  # fmt: skip
    assert read == expected
    layer = "model.layers.1."
    if name == "phi3":  # fused as stored: q, k, v rows and gate, up rows in one tensor each
        assert weights[layer + "self_attn.qkv_proj.weight"].shape == ((4 + 2 * 2) * 16, 64)
        assert weights[layer + "mlp.gate_up_proj.weight"].shape == (2 * 128, 64)
        assert layer + "self_attn.q_proj.weight" not in weights
    else:
        assert weights[layer + "self_attn.k_proj.weight"].shape == (tiny.kv_heads * tiny.dim, 64)
    if name.startswith("gemma"):
        assert weights[layer + "post_feedforward_layernorm.weight"].shape == (64,)
        assert (layer + "self_attn.q_norm.weight" in weights) == (name == "gemma3")
        assert spec.query_pre_attn_scalar == 32.0  # head_dim, not hidden / heads


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_tiny_files_generate_in_the_engine(
    tiny_files: dict[tuple[str, str], Path], name: str, qtype: str
) -> None:
    """Greedy tokens from a prompt longer than the window (8 keys), the same on a second run."""
    from deterministic_inference.config import EngineConfig
    from deterministic_inference.engine.engine import Engine
    from deterministic_inference.engine.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=str(tiny_files[(name, qtype)]), kv_cache_memory=32 * 2**20))
    assert engine.spec.sliding_window == 8
    prompt = "The river ran past the old mill and under the stone bridge to the sea"
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first, again = (engine.generate([prompt], params)[0].outputs[0] for _ in range(2))
    assert len(engine.tokenizer.encode(prompt)) > 8
    assert len(first.token_ids) == 4 and all(np.isfinite(v) for v in first.logprobs)
    assert first.token_ids == again.token_ids


def test_presets_are_the_published_shapes() -> None:
    gemma3, gemma2 = FAMILIES["gemma3"].preset, FAMILIES["gemma2"].preset
    assert (gemma3.hidden, gemma3.layers, gemma3.heads, gemma3.kv_heads, gemma3.dim, gemma3.ffn) == (
        1152, 26, 4, 1, 256, 6912,
    )  # fmt: skip
    assert (gemma3.sliding_window, gemma3.rope_theta, gemma3.tie_embeddings) == (512, 1_000_000.0, True)
    assert (gemma2.hidden, gemma2.layers, gemma2.heads, gemma2.kv_heads, gemma2.dim, gemma2.ffn) == (
        2304, 26, 8, 4, 256, 9216,
    )  # fmt: skip
    assert family("gemma2").extra_metadata == {
        "gemma2.attn_logit_softcapping": 50.0, "gemma2.final_logit_softcapping": 30.0,
    }  # fmt: skip
    mistral, phi3 = FAMILIES["mistral"].preset, FAMILIES["phi3"].preset
    assert (mistral.hidden, mistral.layers, mistral.heads, mistral.kv_heads, mistral.ffn) == (
        4096,
        32,
        32,
        8,
        14336,
    )
    assert mistral.sliding_window == 4096 and family("mistral").gguf_arch == "llama"
    assert (phi3.hidden, phi3.layers, phi3.heads, phi3.kv_heads, phi3.ffn, phi3.dim) == (
        3072,
        32,
        32,
        32,
        8192,
        96,
    )
    # Gemma-3-1B's tensors at the preset: q [4 * 256, 1152], k [256, 1152], per-head q/k norms [256]
    specs = {
        s.name: s
        for s in model_tensors(gemma3, 262144, lambda _l, _n: "F32", family("gemma3").layer_tensors(gemma3))
    }
    assert specs["blk.25.attn_q.weight"].shape == (1024, 1152)
    assert specs["blk.0.attn_k.weight"].shape == (256, 1152)
    assert specs["blk.0.attn_q_norm.weight"].shape == (256,)
    assert "output.weight" not in specs and len(specs) == 2 + 26 * 13
    params = sum(int(np.prod(s.shape)) for s in specs.values())
    assert 0.99e9 < params < 1.01e9  # Gemma-3-1B: 1.0 B parameters with its 262144-token vocabulary


@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_llama_cpp_loads_each_family_and_generates(
    tiny_files: dict[tuple[str, str], Path], name: str
) -> None:
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is only in the bench venv, never a test dependency"
    )
    llm = llama_cpp.Llama(model_path=str(tiny_files[(name, "Q8_0")]), n_ctx=64, verbose=False)
    assert llm.n_vocab() == 49152
    out = llm.create_completion("The river", max_tokens=4, temperature=0.0)
    assert out["usage"]["completion_tokens"] >= 1
