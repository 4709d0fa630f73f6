"""Engine-level invariance with quantized weights (a tiny random file mixing formats like Q4_K_M:
Q4_K, Q5_K, Q6_K, Q8_0 embedding, F32 norms; llama q/k read through row orders).

The same bitwise checks as the dense tests: a prompt alone vs inside mixed batches with chunked
prefill, 1 vs 2 threads, greedy and seeded; decode == prefill logprobs; prompt logprobs through chunking
and preemption; prefix-cache hits. Negative control: the quantized GEMM with its test hook that takes
the activation scales from the whole batch (what llama.cpp-style per-row quantization avoids) must
change some result, and the start-up self-check must name it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.errors import SelfCheckError
from deterministic_inference.model.loader import LoadedModel, load_model
from deterministic_inference.ops.quant import TEST_BATCH_SCALE, QuantLinear
from tests.engine.test_engine_invariance import (
    CASES,
    GREEDY,
    SEEDED,
    Case,
    PromptLogprobBits,
    bits,
    random_prompts,
    result_of,
    run_case,
)
from tests.engine.test_prefix_cache_engine import run_batches, shared_prefix_prompts
from tests.tiny_models import TinyModel

DTYPES = ("bfloat16", "float32")


@pytest.fixture(scope="module")
def mixed(tiny_q4_k_m_gguf: Path) -> LoadedModel:
    return load_model(str(tiny_q4_k_m_gguf))


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def batch_wide_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    """Break the quantized GEMM on purpose: activation block scales from all rows of the call."""
    monkeypatch.setattr(QuantLinear, "__call__", lambda self, x: self.forward_with_flags(x, TEST_BATCH_SCALE))


def target_prompt(loaded: LoadedModel) -> list[int]:
    return random_prompts(1, loaded.spec.vocab_size, seed=7)[0] + list(range(3, 40))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded-T0.8-p0.9"])
def test_prompt_alone_equals_prompt_in_any_batch(
    mixed: LoadedModel, params: SamplingParams, dtype: str, restore_threads: None
) -> None:
    target = target_prompt(mixed)
    alone, _ = run_case(mixed, target, params, Case(0, "first", 512, 1), True, dtype)
    assert len(alone.token_ids) == params.max_tokens
    preempted = 0
    for case in CASES:
        result, preemptions = run_case(mixed, target, params, case, True, dtype)
        preempted += preemptions
        assert result == alone, f"differs in {case}"
    assert preempted > 0, "the small-pool case must actually preempt"


def test_negative_control_batch_wide_activation_scales_differ(
    mixed: LoadedModel, batch_wide_scales: None, restore_threads: None
) -> None:
    target = target_prompt(mixed)
    alone, _ = run_case(mixed, target, GREEDY, Case(0, "first", 512, 1), True, "bfloat16")
    results = [run_case(mixed, target, GREEDY, case, True, "bfloat16")[0] for case in CASES]
    differing = [case for case, result in zip(CASES, results, strict=True) if result != alone]
    assert differing, "a batch-dependent GEMM gave identical bits everywhere: the test above cannot fail"


def test_selfcheck_probes_every_format_and_catches_batch_wide_scales(
    mixed: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(EngineConfig(threads=2), loaded=mixed)  # self-check on
    report = engine.selfcheck_report
    assert report is not None and report.ok, report and report.table()
    linear_shapes = " ".join(r.shape for r in report.results if r.op == "linear")
    for fmt in ("q4_k", "q5_k", "q6_k"):
        assert fmt in linear_shapes, linear_shapes
    assert "lm_head" in linear_shapes and "quant" in linear_shapes
    monkeypatch.setattr(QuantLinear, "__call__", lambda self, x: self.forward_with_flags(x, TEST_BATCH_SCALE))
    with pytest.raises(SelfCheckError, match=r"linear qkv 256->512 bf16->bf16 quant weights q4_k"):
        Engine(EngineConfig(threads=2), loaded=mixed)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_decode_logprobs_equal_prompt_logprobs(mixed: LoadedModel, params: SamplingParams) -> None:
    engine = Engine(EngineConfig(selfcheck=False), loaded=mixed)
    prompt = random_prompts(1, mixed.spec.vocab_size, seed=3)[0] + [5, 6, 7]
    generated = engine.generate([prompt], params)[0].outputs[0]
    scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    scored = engine.generate([prompt + generated.token_ids], scoring)[0]
    assert scored.prompt_logprobs is not None
    tail = scored.prompt_logprobs[len(prompt) :]
    assert [bits(v) for v in tail if v is not None] == [bits(v) for v in generated.logprobs]


def test_prompt_logprobs_survive_chunking_and_preemption(mixed: LoadedModel) -> None:
    prompts = random_prompts(6, mixed.spec.vocab_size, seed=5)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=2)

    def collect(**overrides: object) -> tuple[list[PromptLogprobBits], int]:
        config = EngineConfig(selfcheck=False, **overrides)  # type: ignore[arg-type]
        engine = Engine(config, loaded=mixed, record_trace=True)
        outputs = engine.generate(prompts, params)
        signature = [
            ([None if v is None else bits(v) for v in o.prompt_logprobs or []], o.prompt_top_logprobs)
            for o in outputs
        ]
        return signature, sum(len(plan.preempted_ids) for plan in engine.trace)

    reference, _ = collect()
    squeezed, preemptions = collect(max_num_batched_tokens=7, num_kv_blocks=8)
    assert preemptions > 0 and squeezed == reference


def test_prefix_cache_hits_equal_misses(mixed: LoadedModel) -> None:
    prompts = shared_prefix_prompts(6, prefix_len=70)
    uncached = Engine(EngineConfig(selfcheck=False, enable_prefix_caching=False), loaded=mixed)
    reference = run_batches(uncached, prompts, 6)
    engine = Engine(EngineConfig(selfcheck=False), loaded=mixed)
    cold, warm = run_batches(engine, prompts, 3), run_batches(engine, prompts, 2)
    assert engine.kv.stats.hit_tokens > 0
    assert cold == reference and warm == reference


def test_fingerprint_names_the_formats(mixed: LoadedModel) -> None:
    engine = Engine(EngineConfig(selfcheck=False), loaded=mixed)
    numerics = engine.fingerprint["numerics"]
    assert numerics["quantization"] == "auto"
    assert numerics["weight_formats"]["mlp.down_proj.weight"] == "q4_k+q6_k"
    assert numerics["weight_formats"]["model.embed_tokens.weight"] == "q8_0"
    none = Engine(EngineConfig(selfcheck=False, quantization="none"), loaded=mixed)
    assert none.fingerprint["numerics"]["weight_formats_digest"] != numerics["weight_formats_digest"]
    assert none.system_fingerprint != engine.system_fingerprint


def test_hf_model_quantized_to_q8_0_at_load_is_invariant(
    tiny_llama_dir: TinyModel, restore_threads: None
) -> None:
    """--quantization q8_0 on an HF directory: float matrices become Q8_0 blocks at load and run in the
    quantized GEMM, with the same batch invariance (two of the cases, greedy)."""
    loaded = load_model(str(tiny_llama_dir.path))
    quantized = Engine(EngineConfig(quantization="q8_0", selfcheck=False), loaded=loaded)
    assert quantized.fingerprint["numerics"]["weight_formats"]["mlp.down_proj.weight"] == "q8_0"
    target = target_prompt(loaded)

    def result(case: Case) -> object:
        config = EngineConfig(
            quantization="q8_0", max_num_batched_tokens=case.budget, threads=case.threads,
            enable_prefix_caching=False, selfcheck=False,
        )  # fmt: skip
        prompts = random_prompts(case.others, loaded.spec.vocab_size, seed=case.others) + [target]
        return result_of(Engine(config, loaded=loaded).generate(prompts, GREEDY)[-1])

    alone = result(Case(0, "last", 512, 1))
    assert result(Case(8, "last", 16, 2)) == alone and result(Case(5, "last", 7, 1)) == alone
