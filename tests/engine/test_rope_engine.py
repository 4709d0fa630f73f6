"""Engine-level invariance of rope-scaled models (tests/rope_models.py): a YaRN Qwen2 from its HF
directory (cos / sin scaled by the attention factor), a Llama 3.1 style GGUF (rope_freqs.weight) and a
Phi-3 LongRoPE GGUF (prefix-cache hits past the original context).
Their prompts (150 tokens + 12 generated) run far past original_max_position_embeddings (64), so the
scaled frequencies decide every later rotation; the prompt's tokens and logprob bits alone equal those
inside batches with chunked prefill (budgets 7, 16, 64), 1 vs 2 threads and preemption. Negative
control: the same cases with plain ops differ somewhere."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.model.loader import LoadedModel, load_model
from tests.engine.test_engine_invariance import CASES, GREEDY, SEEDED, Case, random_prompts, run_case
from tests.engine.test_prefix_cache_engine import run_batches, shared_prefix_prompts
from tests.rope_models import ORIGINAL, PROMPT_LEN, build_scaled_hf, write_scaled_gguf


@pytest.fixture(scope="module")
def yarn_hf(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(build_scaled_hf(tmp_path_factory.mktemp("yarn"), "yarn").path))


@pytest.fixture(scope="module")
def llama3_gguf(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    directory = tmp_path_factory.mktemp("llama3")
    tiny = build_scaled_hf(directory / "hf", "llama3")
    return load_model(str(write_scaled_gguf(tiny, "llama3", directory / "tiny-llama31.F32.gguf")))


@pytest.fixture(scope="module")
def longrope_gguf(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    directory = tmp_path_factory.mktemp("longrope")
    tiny = build_scaled_hf(directory / "hf", "longrope")
    return load_model(str(write_scaled_gguf(tiny, "longrope", directory / "tiny-phi3-128k.F32.gguf")))


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def target_prompt(loaded: LoadedModel) -> list[int]:
    return random_prompts(1, loaded.spec.vocab_size, seed=7)[0] + list(range(3, 3 + PROMPT_LEN - 40))


@pytest.mark.parametrize(
    ("fixture", "params"),
    [("yarn_hf", GREEDY), ("llama3_gguf", SEEDED)],
    ids=["yarn-hf-greedy", "llama3-rope-freqs-gguf-seeded"],
)
def test_prompt_alone_equals_prompt_in_any_batch(
    fixture: str, params: object, request: pytest.FixtureRequest, restore_threads: None
) -> None:
    loaded: LoadedModel = request.getfixturevalue(fixture)
    assert loaded.spec.rope_scaling is not None
    target = target_prompt(loaded)
    assert len(target) > 2 * ORIGINAL
    alone, _ = run_case(loaded, target, params, Case(0, "first", 512, 1), True)  # type: ignore[arg-type]
    preempted = 0
    for case in CASES:
        result, preemptions = run_case(loaded, target, params, case, True)  # type: ignore[arg-type]
        preempted += preemptions
        assert result == alone, f"differs in {case}"
    assert preempted > 0, "the small-pool case must actually preempt"


def test_negative_control_plain_ops_differ(yarn_hf: LoadedModel, restore_threads: None) -> None:
    target = target_prompt(yarn_hf)
    alone, _ = run_case(yarn_hf, target, GREEDY, Case(0, "first", 512, 1), False)
    differing = [case for case in CASES if run_case(yarn_hf, target, GREEDY, case, False)[0] != alone]
    assert differing, "plain ops gave identical bits everywhere: the invariance test cannot fail"


def test_prefix_cache_hits_past_the_original_context_equal_misses(longrope_gguf: LoadedModel) -> None:
    """A Phi-3 LongRoPE file (long factors, attention factor): a shared prefix of 100 tokens, longer than
    the original context, cold and warm cache equal no cache."""
    prompts = shared_prefix_prompts(6, prefix_len=100)
    reference = run_batches(
        Engine(EngineConfig(selfcheck=False, enable_prefix_caching=False), loaded=longrope_gguf), prompts, 6
    )
    engine = Engine(EngineConfig(selfcheck=False), loaded=longrope_gguf)
    assert engine.fingerprint["numerics"]["model_ops"] == ["rope_longrope_long"]
    cold, warm = run_batches(engine, prompts, 3), run_batches(engine, prompts, 2)
    assert engine.kv.stats.hit_tokens > 0
    assert cold == reference and warm == reference
