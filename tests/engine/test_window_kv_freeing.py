"""KV blocks behind an all-layer sliding window go back to the pool (engine/kv_cache.py), and that changes
no bit. Tiny random Mistral (every layer windowed, window 24 keys) and Gemma 3 (5 windowed layers, 1 global:
nothing may be freed), KV blocks of 16.

Memory: a sequence of prompt + generation about 10 windows long holds at most
`window_block_limit(chunk)` blocks, measured in the engine's block pool while each step runs; with freeing
off (the negative control) it holds one block per 16 tokens. Bits: freeing on equals freeing off, the
window's edge crossing chunk boundaries (budgets 7, 16, 64) and block boundaries, alone vs mixed batches,
greedy and seeded, threads 1 and 2, preemption, prefix hits (also after eviction) and speculation.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.kv_cache import FREED_BLOCK
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.engine.speculative import SpeculativeConfig
from deterministic_inference.errors import InvalidRequestError
from deterministic_inference.model.loader import LoadedModel, load_model
from tests.arch_models import WINDOW, build_arch_hf, write_arch_gguf
from tests.engine.test_engine_invariance import (
    CASES,
    GREEDY,
    SEEDED,
    Case,
    Result,
    random_prompts,
    result_of,
    run_case,
)
from tests.engine.test_prefix_cache_engine import run_batches, shared_prefix_prompts

BLOCK = 16
LONG = SamplingParams(max_tokens=200, temperature=0.8, seed=5, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(build_arch_hf(tmp_path_factory.mktemp("mistral"), "mistral").path))


@pytest.fixture(scope="module")
def phi3_q8(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    directory = tmp_path_factory.mktemp("phi3")
    tiny = build_arch_hf(directory / "hf", "phi3")
    return load_model(str(write_arch_gguf(tiny, directory / "tiny-phi3.Q8_0.gguf", quant="Q8_0")))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    directory = tmp_path_factory.mktemp("gemma3")
    tiny = build_arch_hf(directory / "hf", "gemma3")
    return load_model(str(write_arch_gguf(tiny, directory / "tiny-gemma3.Q8_0.gguf", quant="Q8_0")))


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def long_prompt(loaded: LoadedModel) -> list[int]:
    """61 tokens: with LONG's 200 outputs, about 10 windows of 24."""
    return random_prompts(1, loaded.spec.vocab_size, seed=7)[0] + list(range(3, 40))


def run_long(loaded: LoadedModel, free: bool, budget: int, **overrides: object) -> tuple[Result, int, int]:
    """The long sequence alone: its result, the most KV blocks the pool had in use while a step ran
    (read inside the forward pass, after the step's allocation), and the most its block table held."""
    settings: dict[str, object] = dict(
        dtype="float32", selfcheck=False, max_num_batched_tokens=budget, free_kv_outside_window=free
    )
    settings.update(overrides)
    engine = Engine(EngineConfig(**settings), loaded=loaded, record_trace=True)  # type: ignore[arg-type]
    peak_used = 0

    def measure(step: int, layer: int, ids: list[str], rows: list[int], hidden: torch.Tensor) -> None:
        nonlocal peak_used
        peak_used = max(peak_used, engine.kv.num_used_blocks)

    output = engine.generate([long_prompt(loaded)], LONG, layer_hook=measure)[0]
    held = max(sum(1 for b in c.block_ids if b != FREED_BLOCK) for p in engine.trace for c in p.chunks)
    assert engine.kv.num_used_blocks == 0  # everything went back when it finished
    return result_of(output), peak_used, held


@pytest.mark.parametrize("budget", [7, 16, 64])
def test_a_long_sequence_holds_only_its_window(mistral: LoadedModel, budget: int) -> None:
    assert mistral.spec.all_layers_window == WINDOW
    total = len(long_prompt(mistral)) + LONG.max_tokens
    assert total > 10 * WINDOW
    freed, freed_peak, freed_held = run_long(mistral, True, budget)
    kept, kept_peak, kept_held = run_long(mistral, False, budget)
    limit = -(-(WINDOW - 1 + budget) // BLOCK) + 1  # ceil((W - 1 + chunk) / block) + 1
    assert freed_peak <= limit and freed_held <= limit, (freed_peak, freed_held, limit)
    assert kept_peak == kept_held == -(-(total - 1) // BLOCK)  # negative control: the whole sequence
    assert freed == kept  # same tokens and logprob bits


def test_a_quantized_gguf_in_bf16_holds_only_its_window(phi3_q8: LoadedModel) -> None:
    """Phi-3 from a Q8_0 GGUF file, bf16 KV cache: the same bound and the same bits as without freeing."""
    assert phi3_q8.spec.all_layers_window == WINDOW
    freed, peak, held = run_long(phi3_q8, True, 16, dtype="bfloat16")
    kept, kept_peak, _ = run_long(phi3_q8, False, 16, dtype="bfloat16")
    assert peak <= 4 and held <= 4 and kept_peak > 4 * 4
    assert freed == kept


def test_a_pool_smaller_than_the_sequence_serves_it(mistral: LoadedModel) -> None:
    """Admission counts the window's blocks: 6 blocks hold a 261-token sequence, with the bits of a big
    pool; with freeing off the same request is refused, naming max_tokens."""
    big, _, _ = run_long(mistral, False, 16)
    small, peak, _ = run_long(mistral, True, 16, num_kv_blocks=6)
    assert small == big and peak <= 4
    engine = Engine(
        EngineConfig(dtype="float32", selfcheck=False, num_kv_blocks=6, free_kv_outside_window=False),
        loaded=mistral,
    )
    with pytest.raises(InvalidRequestError) as refused:
        engine.add_request(long_prompt(mistral), LONG)
    assert refused.value.param == "max_tokens"


def freed_somewhere(engine: Engine) -> bool:
    """Whether some step's block table had a released entry (the window freeing really happened)."""
    return any(FREED_BLOCK in chunk.block_ids for plan in engine.trace for chunk in plan.chunks)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_freeing_changes_no_bit_in_any_batch(
    mistral: LoadedModel, params: SamplingParams, restore_threads: None
) -> None:
    """The invariance cases (mixed batches, chunk budgets 7/16/64, threads 1/2, a small pool that
    preempts): freeing on equals freeing off and equals the prompt alone."""
    target = long_prompt(mistral)
    alone, _ = run_case(mistral, target, params, Case(0, "first", 512, 1), True, free_kv_outside_window=False)
    seen: list[bool] = []
    preempted = 0
    for case in CASES:
        freed, preemptions = run_case(
            mistral, target, params, case, True, inspect=lambda e: seen.append(freed_somewhere(e))
        )
        kept, _ = run_case(mistral, target, params, case, True, free_kv_outside_window=False)
        preempted += preemptions
        assert freed == kept == alone, f"differs in {case}"
    assert all(seen), "every case must actually release blocks"
    assert preempted > 0, "the small-pool case must actually preempt"


def test_prefix_hits_across_released_blocks_equal_no_cache(mistral: LoadedModel) -> None:
    """A shared 70-token prefix: its first blocks are released behind the window (cached, evictable).
    Cold, warm and evicted-under-pressure caches equal no cache and no freeing; warm hits skip the
    blocks before the window (not taken)."""
    prompts = shared_prefix_prompts(6, prefix_len=70)
    reference = run_batches(
        Engine(
            EngineConfig(selfcheck=False, enable_prefix_caching=False, free_kv_outside_window=False),
            loaded=mistral,
        ),
        prompts,
        6,
    )
    engine = Engine(EngineConfig(selfcheck=False), loaded=mistral, record_trace=True)
    cold, warm = run_batches(engine, prompts, 3), run_batches(engine, prompts, 2)
    assert engine.kv.stats.hit_tokens > 0 and freed_somewhere(engine)
    assert cold == reference and warm == reference
    squeezed = Engine(EngineConfig(selfcheck=False, num_kv_blocks=8), loaded=mistral)
    pressed = run_batches(squeezed, prompts, 1) + run_batches(squeezed, prompts, 3)
    assert squeezed.kv.stats.evictions > 0 and squeezed.kv.stats.hit_tokens > 0
    assert pressed == reference + reference


def test_speculation_rolls_back_only_kept_blocks(mistral: LoadedModel) -> None:
    """n-gram speculation (repetitive prompt, so drafts are accepted and rejected) with freeing on gives
    the bits of plain decoding with freeing off."""
    prompt = [5, 6, 7, 8, 9, 10] * 12
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, logprobs=1)

    def run(free: bool, speculative: SpeculativeConfig | None) -> Result:
        config = EngineConfig(
            selfcheck=False, free_kv_outside_window=free, speculative_config=speculative, dtype="float32"
        )
        engine = Engine(config, loaded=mistral)
        result = result_of(engine.generate([prompt], params)[0])
        if speculative is not None:
            assert engine.scheduler.spec_stats.num_drafts > 0
        return result

    ngram = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3)
    assert run(True, ngram) == run(False, None)


def test_a_model_with_a_global_layer_frees_nothing(gemma3: LoadedModel) -> None:
    """Gemma 3's global layer sees every key: the pool keeps the whole sequence (window limit 0)."""
    assert gemma3.spec.sliding_window == WINDOW and gemma3.spec.all_layers_window == 0
    engine = Engine(EngineConfig(selfcheck=False), loaded=gemma3, record_trace=True)
    prompt = long_prompt(gemma3)
    engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    assert engine.kv.window_block_limit(512) == 0 and not freed_somewhere(engine)
    held = max(len(chunk.block_ids) for plan in engine.trace for chunk in plan.chunks)
    assert held == -(-(len(prompt) + 39) // BLOCK)


def test_negative_control_plain_ops_differ(mistral: LoadedModel, restore_threads: None) -> None:
    """The comparison above can fail: with plain ops (freeing on) some case differs from the prompt
    alone."""
    target = long_prompt(mistral)
    alone, _ = run_case(mistral, target, GREEDY, Case(0, "first", 512, 1), False)
    differing = [case for case in CASES if run_case(mistral, target, GREEDY, case, False)[0] != alone]
    assert differing, "plain ops gave identical bits everywhere: the invariance test cannot fail"


@pytest.mark.parametrize("batch_invariant", [True, False], ids=["kernel", "plain-sdpa"])
def test_a_block_released_inside_the_window_is_never_read(
    mistral: LoadedModel, batch_invariant: bool
) -> None:
    """Negative control of the release rule: a pool that releases for a window of 8 keys while the model
    attends over 24 leaves released entries inside a query's window; the attention refuses them (the
    kernel's bounds check, the plain path's check) instead of reading another sequence's block."""
    config = EngineConfig(selfcheck=False, dtype="float32", batch_invariant=batch_invariant)
    engine = Engine(config, loaded=mistral)
    engine.kv.sliding_window = 8
    with pytest.raises(ValueError, match="out of range|was released"):
        engine.generate([long_prompt(mistral)], SamplingParams(max_tokens=4, temperature=0.0))


def test_without_prefix_caching_released_blocks_are_reused_first(mistral: LoadedModel) -> None:
    """Released blocks that are not cached go straight back to the free heap (lowest id first), so the
    sequence keeps reusing the same few blocks: the resident KV pages follow the window too. (With the
    prefix cache on, released blocks stay cached and evictable, as a finished request's do.)"""
    engine = Engine(
        EngineConfig(selfcheck=False, max_num_batched_tokens=16, enable_prefix_caching=False),
        loaded=mistral,
        record_trace=True,
    )
    engine.generate([long_prompt(mistral)], LONG)
    highest = max(max(chunk.block_ids) for plan in engine.trace for chunk in plan.chunks)
    assert highest < engine.kv.window_block_limit(16)
