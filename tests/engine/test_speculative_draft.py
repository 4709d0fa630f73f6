"""method draft_model: a smaller model with the target's vocabulary drafts greedily; the target verifies
exactly, so outputs are bitwise plain decoding's (tokens, logprob and top-logprob bits), greedy and
seeded, with a tiny unrelated draft and with the target as its own draft (acceptance near 100% for
greedy), alone and in mixed batches with chunked prefill, preemption and prefix-cache hits. The negative
control (the standard rejection sampler at T > 0) is detected as different. Bad drafts are refused at
start-up naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from deterministic_inference.engine import spec_verify
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.engine.speculative import SpeculativeConfig
from deterministic_inference.errors import ConfigError
from deterministic_inference.model.loader import LoadedModel, load_model
from tests.engine.test_speculative import (
    GREEDY,
    SEEDED,
    accepted,
    assert_mixed_batches_equal_plain,
    copy_heavy_prompts,
    engine_for,
    rejection_verify,
    run,
    run_with_prefix_hits,
)
from tests.tiny_models import TinyModel, build_hf_model, build_wide_vocab_model


@pytest.fixture(scope="module")
def tiny_loaded(tiny_llama_dir: TinyModel) -> LoadedModel:
    return load_model(str(tiny_llama_dir.path))


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama with the same tokenizer but other weights (seed 1)."""
    return build_hf_model(tmp_path_factory.mktemp("tiny-draft"), "llama", seed=1).path


def draft(path: Path, k: int = 4) -> SpeculativeConfig:
    """Draft with the model at `path`, at any batch size (the mixed batches need drafted rows)."""
    return SpeculativeConfig(
        method="draft_model", model=str(path), num_speculative_tokens=k, disable_by_batch_size=None
    )


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


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_draft_model_in_mixed_batches_equals_plain(
    tiny_loaded: LoadedModel, tiny_llama_dir: TinyModel, params: SamplingParams
) -> None:
    """Drafted rows share steps with a T=0.7 neighbour every third row (drafted too, rarely accepted):
    no chunking, chunked prefill (budget 7), preemption (a small pool of small blocks), with the target
    as its own draft so that long runs are accepted."""
    prompts = copy_heavy_prompts(tiny_loaded.spec.vocab_size, 9, seed=12)
    assert_mixed_batches_equal_plain(tiny_loaded, prompts, params, draft(tiny_llama_dir.path))


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_draft_model_with_prefix_hits_equals_plain(
    tiny_loaded: LoadedModel, tiny_llama_dir: TinyModel, other_draft: Path, params: SamplingParams
) -> None:
    """A warm prefix cache gives plain bits with either draft, and no cached block ever holds an
    unverified token (`run_with_prefix_hits` checks it after every step)."""
    prompts = copy_heavy_prompts(tiny_loaded.spec.vocab_size, 6, seed=13)
    reference = [run(tiny_loaded, [p], params, None)[0][0] for p in prompts]
    for path in (tiny_llama_dir.path, other_draft):
        rounds, engine = run_with_prefix_hits(tiny_loaded, prompts, params, draft(path))
        assert rounds == [reference, reference], f"differs with draft {path}"
        assert engine.kv.stats.hit_tokens > 0 and engine.stats()["spec_decode"]["num_drafts"] > 0
    assert accepted(engine) >= 0  # the unrelated draft may never be right; the target's own is checked


def test_draft_model_negative_control_rejection_sampler_differs(
    tiny_loaded: LoadedModel, tiny_llama_dir: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the standard rejection sampler in place of exact verification (a greedy draft has q = 1 at
    its token, as prompt lookup does), the comparison above finds a difference at T > 0 (0.3: low enough
for the target's own greedy drafts to be accepted at times)."""
    params = SamplingParams(max_tokens=32, temperature=0.3, seed=1234, ignore_eos=True)
    prompts = copy_heavy_prompts(tiny_loaded.spec.vocab_size, 6, seed=1)
    reference = [run(tiny_loaded, [p], params, None)[0][0] for p in prompts]
    exact, engine = run(tiny_loaded, prompts, params, draft(tiny_llama_dir.path))
    assert exact == reference and accepted(engine) > 0
    monkeypatch.setattr(spec_verify, "verify_drafts", rejection_verify)
    rejected = run(tiny_loaded, prompts, params, draft(tiny_llama_dir.path))[0]
    differing = [i for i, (a, b) in enumerate(zip(rejected, reference, strict=True)) if a != b]
    assert differing, "the rejection sampler gave plain decoding's tokens: the tests cannot fail"


def test_bad_draft_model_names_the_field(tiny_loaded: LoadedModel, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"speculative_config\.model: .* does not exist"):
        engine_for(tiny_loaded, draft(tmp_path / "missing.gguf"))
    wide = build_wide_vocab_model(tmp_path / "wide", vocab_size=tiny_loaded.spec.vocab_size + 64)
    with pytest.raises(ConfigError, match=r"speculative_config\.model: the draft's vocabulary"):
        engine_for(tiny_loaded, draft(wide))
    with pytest.raises(ConfigError, match=r"speculative_config\.model: missing"):
        SpeculativeConfig(method="draft_model")
