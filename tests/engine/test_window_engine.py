"""Engine-level invariance of sliding-window models (tiny random Mistral from its HF directory, Phi-3 and
Gemma 3 from Q8_0 GGUF files, Gemma 2 (soft-capped) from its HF directory; window 24 keys, KV blocks of
16): the window's edge crosses chunk boundaries (budgets 7, 16, 64), block boundaries and prefix-cache
hits, and a prompt's tokens and logprob bits stay those of the prompt alone. Negative control: the same
cases with plain ops differ somewhere."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.model.loader import LoadedModel, load_model
from tests.arch_models import WINDOW, build_arch_hf, write_arch_gguf
from tests.engine.test_engine_invariance import CASES, GREEDY, SEEDED, Case, random_prompts, run_case
from tests.engine.test_prefix_cache_engine import run_batches, shared_prefix_prompts


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(build_arch_hf(tmp_path_factory.mktemp("mistral"), "mistral").path))


@pytest.fixture(scope="module")
def phi3_q8(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    directory = tmp_path_factory.mktemp("phi3")
    tiny = build_arch_hf(directory / "hf", "phi3")
    return load_model(str(write_arch_gguf(tiny, directory / "tiny-phi3.Q8_0.gguf", quant="Q8_0")))


@pytest.fixture(scope="module")
def gemma3_q8(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    directory = tmp_path_factory.mktemp("gemma3")
    tiny = build_arch_hf(directory / "hf", "gemma3")
    return load_model(str(write_arch_gguf(tiny, directory / "tiny-gemma3.Q8_0.gguf", quant="Q8_0")))


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(build_arch_hf(tmp_path_factory.mktemp("gemma2"), "gemma2").path))


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def target_prompt(loaded: LoadedModel) -> list[int]:
    """About 80 tokens: prefill and decode both run with windows that start past key 0."""
    return random_prompts(1, loaded.spec.vocab_size, seed=7)[0] + list(range(3, 40))


@pytest.mark.parametrize(
    ("fixture", "dtype", "params"),
    [
        ("mistral", "float32", GREEDY),
        ("phi3_q8", "bfloat16", SEEDED),
        ("gemma3_q8", "bfloat16", GREEDY),
        ("gemma2", "float32", SEEDED),
    ],
    ids=[
        "mistral-hf-fp32-greedy",
        "phi3-gguf-q8_0-bf16-seeded",
        "gemma3-gguf-q8_0-bf16-greedy",
        "gemma2-hf-seeded",
    ],
)
def test_prompt_alone_equals_prompt_in_any_batch(
    fixture: str, dtype: str, params: object, request: pytest.FixtureRequest, restore_threads: None
) -> None:
    loaded: LoadedModel = request.getfixturevalue(fixture)
    assert loaded.spec.sliding_window == WINDOW
    target = target_prompt(loaded)
    assert len(target) > 2 * WINDOW
    alone, _ = run_case(loaded, target, params, Case(0, "first", 512, 1), True, dtype)  # type: ignore[arg-type]
    preempted = 0
    for case in CASES:
        result, preemptions = run_case(loaded, target, params, case, True, dtype)  # type: ignore[arg-type]
        preempted += preemptions
        assert result == alone, f"differs in {case}"
    assert preempted > 0, "the small-pool case must actually preempt"


def test_negative_control_plain_ops_differ(mistral: LoadedModel, restore_threads: None) -> None:
    target = target_prompt(mistral)
    alone, _ = run_case(mistral, target, GREEDY, Case(0, "first", 512, 1), False)
    differing = [case for case in CASES if run_case(mistral, target, GREEDY, case, False)[0] != alone]
    assert differing, "plain ops gave identical bits everywhere: the invariance test cannot fail"


@pytest.mark.parametrize("fixture", ["mistral", "phi3_q8", "gemma3_q8"])
def test_prefix_cache_hits_across_the_window_equal_misses(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    """A shared prefix of 70 tokens (the window ends inside it): cold and warm cache equal no cache."""
    loaded: LoadedModel = request.getfixturevalue(fixture)
    prompts = shared_prefix_prompts(6, prefix_len=70)
    reference = run_batches(
        Engine(EngineConfig(selfcheck=False, enable_prefix_caching=False), loaded=loaded), prompts, 6
    )
    engine = Engine(EngineConfig(selfcheck=False), loaded=loaded)
    cold, warm = run_batches(engine, prompts, 3), run_batches(engine, prompts, 2)
    assert engine.kv.stats.hit_tokens > 0
    assert cold == reference and warm == reference


def test_selfcheck_probes_the_window_and_gelu(gemma3_q8: LoadedModel) -> None:
    """Both attentions (global and windowed) and the GELU-tanh MLP are probed; the fingerprint names them."""
    engine = Engine(EngineConfig(threads=2, dtype="float32"), loaded=gemma3_q8)
    report = engine.selfcheck_report
    assert report is not None and report.ok, report and report.table()
    shapes = [r.shape for r in report.results if r.op == "attention"]
    assert len(shapes) == 2 and any(f"window {WINDOW} (probed at {WINDOW})" in s for s in shapes), shapes
    assert [r.shape for r in report.results if r.op == "gelu_tanh_mul"] == ["[M, 128] fp32"]
    assert engine.fingerprint["numerics"]["model_ops"] == [
        "gelu_tanh_mul",
        "gemma_block",
        "sliding_window_attention",
    ]


def test_selfcheck_probes_soft_capped_attention_and_logits(gemma2: LoadedModel) -> None:
    report = Engine(EngineConfig(threads=2, dtype="float32"), loaded=gemma2).selfcheck_report
    assert report is not None and report.ok, report and report.table()
    shapes = [r.shape for r in report.results if r.op == "attention"]
    assert all("softcap 0.05" in shape for shape in shapes) and len(shapes) == 2, shapes
    assert [r.op for r in report.results if r.op == "softcap"] == ["softcap"]
