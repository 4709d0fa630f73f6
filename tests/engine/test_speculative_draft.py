"""method draft_model: a smaller model with the target's vocabulary drafts greedily; the target verifies
exactly, so outputs are bitwise plain decoding's, with a tiny unrelated draft and with the target as its
own draft (acceptance near 100% for greedy). Bad drafts are refused at start-up naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.engine.speculative import SpeculativeConfig
from deterministic_inference.errors import ConfigError
from deterministic_inference.model.loader import LoadedModel, load_model
from tests.engine.test_speculative import GREEDY, SEEDED, accepted, copy_heavy_prompts, engine_for, run
from tests.tiny_models import TinyModel, build_hf_model, build_wide_vocab_model


@pytest.fixture(scope="module")
def tiny_loaded(tiny_llama_dir: TinyModel) -> LoadedModel:
    return load_model(str(tiny_llama_dir.path))


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama with the same tokenizer but other weights (seed 1)."""
    return build_hf_model(tmp_path_factory.mktemp("tiny-draft"), "llama", seed=1).path


def draft(path: Path, k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model=str(path), num_speculative_tokens=k)


def test_target_as_its_own_draft(tiny_loaded: LoadedModel, tiny_llama_dir: TinyModel) -> None:
    prompts = copy_heavy_prompts(tiny_loaded.spec.vocab_size, 3, seed=6)
    reference = [run(tiny_loaded, [p], GREEDY, None)[0][0] for p in prompts]
    got, engine = run(tiny_loaded, prompts, GREEDY, draft(tiny_llama_dir.path))
    assert got == reference
    stats = engine.stats()["spec_decode"]
    assert stats["num_accepted_tokens"] >= 0.9 * stats["num_draft_tokens"] > 0


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_tiny_draft_equals_plain(tiny_loaded: LoadedModel, other_draft: Path, params: SamplingParams) -> None:
    prompts = copy_heavy_prompts(tiny_loaded.spec.vocab_size, 6, seed=7)
    reference = [run(tiny_loaded, [p], params, None)[0][0] for p in prompts]
    for overrides in ({}, {"max_num_batched_tokens": 64, "kv_block_size": 4, "num_kv_blocks": 30}):
        got, engine = run(tiny_loaded, prompts, params, draft(other_draft), **overrides)
        assert got == reference, f"differs with {overrides}"
        assert engine.stats()["spec_decode"]["num_drafts"] > 0
    assert accepted(engine) >= 0  # an unrelated draft may never be right: only the bits matter


def test_bad_draft_model_names_the_field(tiny_loaded: LoadedModel, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"speculative_config\.model: .* does not exist"):
        engine_for(tiny_loaded, draft(tmp_path / "missing.gguf"))
    wide = build_wide_vocab_model(tmp_path / "wide", vocab_size=tiny_loaded.spec.vocab_size + 64)
    with pytest.raises(ConfigError, match=r"speculative_config\.model: the draft's vocabulary"):
        engine_for(tiny_loaded, draft(wide))
    with pytest.raises(ConfigError, match=r"speculative_config\.model: missing"):
        SpeculativeConfig(method="draft_model")
