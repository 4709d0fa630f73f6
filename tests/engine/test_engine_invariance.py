"""Engine-level invariance on a tiny random Llama: a prompt's tokens and logprob bits do not depend on
batch composition, position in the batch, chunked prefill, preemption, threads or sampling mode; with the
model-dtype KV cache and with `--kv-cache-dtype q8_0` (on a tiny Llama of head_dim 32).

Every comparison is bitwise (float32 bits of the logprobs, exact token ids), and the negative control
runs the same cases with batch_invariant=False and must find at least one difference.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.model.loader import LoadedModel, load_model
from tests.tiny_models import TinyModel

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True, logprobs=3)
# One output's prompt logprobs as raw bits (None for the first token) and its prompt top logprobs.
PromptLogprobBits = tuple[list[int | None], list[list[tuple[int, float]]] | None]


@dataclass(frozen=True)
class Case:
    """One batch setting the target prompt is run in."""

    others: int  # other prompts in the batch
    position: str  # "first", "last" or "middle"
    budget: int  # max_num_batched_tokens (small = chunked prefill)
    threads: int
    num_kv_blocks: int | None = None  # small = forced preemption


@dataclass(frozen=True)
class Result:
    token_ids: tuple[int, ...]
    logprob_bits: tuple[int, ...]
    top_bits: tuple[tuple[tuple[int, int], ...], ...]


def bits(value: float) -> int:
    """Raw float32 bits (so -0.0 != +0.0 and no tolerance can hide a difference)."""
    return int(struct.unpack("<I", struct.pack("<f", value))[0])


def result_of(output: object) -> Result:
    choice = output.outputs[0]  # type: ignore[attr-defined]
    return Result(
        tuple(choice.token_ids),
        tuple(bits(v) for v in choice.logprobs),
        tuple(tuple((t, bits(v)) for t, v in step) for step in choice.top_logprobs),
    )


@pytest.fixture(scope="module")
def tiny_loaded(tiny_llama_dir: TinyModel) -> LoadedModel:
    return load_model(str(tiny_llama_dir.path))


@pytest.fixture(scope="module")
def tiny32_loaded(tiny_llama32_dir: TinyModel) -> LoadedModel:
    return load_model(str(tiny_llama32_dir.path))


# the model each KV cache format runs on (q8_0 stores 32-value groups: head_dim 32)
KV_MODELS = {"auto": "tiny_loaded", "q8_0": "tiny32_loaded"}


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def random_prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 60))] for _ in range(count)]


def run_case(
    loaded: LoadedModel,
    target: list[int],
    params: SamplingParams,
    case: Case,
    batch_invariant: bool,
    dtype: str = "float32",
    kv_cache_dtype: str = "auto",
    inspect: Callable[[Engine], None] | None = None,
    **overrides: Any,
) -> tuple[Result, int]:
    """The target's result inside the case's batch, and how many preemptions happened. `overrides` are
    further EngineConfig fields; `inspect` sees the engine (with its trace) after the run."""
    settings: dict[str, Any] = dict(
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        batch_invariant=batch_invariant,
        max_num_batched_tokens=case.budget,
        threads=case.threads,
        num_kv_blocks=case.num_kv_blocks,
        enable_prefix_caching=False,
        selfcheck=False,
    )
    config = EngineConfig(**{**settings, **overrides})
    engine = Engine(config, loaded=loaded, record_trace=True)
    others = random_prompts(case.others, loaded.spec.vocab_size, seed=case.others * 31 + case.budget)
    index = {"first": 0, "last": len(others), "middle": len(others) // 2}[case.position]
    prompts = others[:index] + [target] + others[index:]
    other_params = SamplingParams(max_tokens=12, temperature=0.7, seed=99, ignore_eos=True)
    params_list = [other_params] * len(prompts)
    params_list[index] = params
    outputs = engine.generate(prompts, params_list)
    preemptions = sum(len(plan.preempted_ids) for plan in engine.trace)
    if inspect is not None:
        inspect(engine)
    return result_of(outputs[index]), preemptions


CASES = [
    Case(others=2, position="first", budget=512, threads=1),
    Case(others=8, position="last", budget=16, threads=2),
    Case(others=32, position="middle", budget=64, threads=2),
    Case(others=5, position="last", budget=7, threads=1),
    Case(others=16, position="first", budget=512, threads=2, num_kv_blocks=24),
]


@pytest.mark.parametrize("kv", list(KV_MODELS))
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded-T0.8-p0.9"])
def test_prompt_alone_equals_prompt_in_any_batch(
    request: pytest.FixtureRequest, params: SamplingParams, kv: str, restore_threads: None
) -> None:
    loaded: LoadedModel = request.getfixturevalue(KV_MODELS[kv])
    target = random_prompts(1, loaded.spec.vocab_size, seed=7)[0] + list(range(3, 40))
    alone, _ = run_case(loaded, target, params, Case(0, "first", 512, 1), True, kv_cache_dtype=kv)
    assert len(alone.token_ids) == params.max_tokens
    preempted = 0
    for case in CASES:
        result, preemptions = run_case(loaded, target, params, case, True, kv_cache_dtype=kv)
        preempted += preemptions
        assert result == alone, f"differs in {case}"
    assert preempted > 0, "the small-pool case must actually preempt"


@pytest.mark.parametrize("kv", list(KV_MODELS))
def test_negative_control_plain_ops_differ(
    request: pytest.FixtureRequest, kv: str, restore_threads: None
) -> None:
    """With invariant ops off, the same cases must show a difference, or the test above proves nothing."""
    loaded: LoadedModel = request.getfixturevalue(KV_MODELS[kv])
    target = random_prompts(1, loaded.spec.vocab_size, seed=7)[0] + list(range(3, 40))
    alone, _ = run_case(loaded, target, GREEDY, Case(0, "first", 512, 1), False, kv_cache_dtype=kv)
    differing = [
        case for case in CASES if run_case(loaded, target, GREEDY, case, False, kv_cache_dtype=kv)[0] != alone
    ]
    assert differing, "plain ops gave identical bits everywhere: the invariance test cannot fail"


def test_q8_kv_cache_changes_the_numbers_and_the_fingerprint(tiny32_loaded: LoadedModel) -> None:
    """q8_0 is a setting that changes bits on purpose: other logprobs, another fingerprint (auto and bf16
    under an fp32 model also differ from each other; auto keeps the fingerprint without the field)."""
    target = random_prompts(1, tiny32_loaded.spec.vocab_size, seed=7)[0]
    results, fingerprints = {}, {}
    for kv in ("auto", "bf16", "q8_0"):
        config = EngineConfig(dtype="float32", kv_cache_dtype=kv, selfcheck=False)
        engine = Engine(config, loaded=tiny32_loaded)
        results[kv] = result_of(engine.generate([target], GREEDY)[0])
        fingerprints[kv] = engine.system_fingerprint
        assert engine.fingerprint["numerics"].get("kv_cache_dtype") == {"auto": None, "bf16": "bfloat16"}.get(
            kv, kv
        )
    assert results["q8_0"].logprob_bits != results["auto"].logprob_bits
    assert len(set(fingerprints.values())) == 3


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_decode_logprobs_equal_prompt_logprobs(tiny_loaded: LoadedModel, params: SamplingParams) -> None:
    """RL contract: the logprob of each sampled token equals its logprob when prompt+output is scored."""
    engine = Engine(EngineConfig(dtype="float32", selfcheck=False), loaded=tiny_loaded)
    prompt = random_prompts(1, tiny_loaded.spec.vocab_size, seed=3)[0] + [5, 6, 7]
    generated = engine.generate([prompt], params)[0].outputs[0]
    scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    scored = engine.generate([prompt + generated.token_ids], scoring)[0]
    assert scored.prompt_logprobs is not None
    tail = scored.prompt_logprobs[len(prompt) :]
    assert [bits(v) for v in tail if v is not None] == [bits(v) for v in generated.logprobs]


def test_prompt_logprobs_survive_chunking_and_preemption(tiny_loaded: LoadedModel) -> None:
    """Prompt logprobs collected over 7-token chunks with preemptions equal one unchunked prefill."""
    prompts = random_prompts(6, tiny_loaded.spec.vocab_size, seed=5)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=2)

    def collect(**overrides: object) -> tuple[list[PromptLogprobBits], int]:
        settings: dict[str, object] = {"dtype": "float32", "selfcheck": False}
        settings.update(overrides)
        engine = Engine(EngineConfig(**settings), loaded=tiny_loaded, record_trace=True)  # type: ignore[arg-type]
        outputs = engine.generate(prompts, params)
        preemptions = sum(len(plan.preempted_ids) for plan in engine.trace)
        signature = [
            ([None if v is None else bits(v) for v in o.prompt_logprobs or []], o.prompt_top_logprobs)
            for o in outputs
        ]
        return signature, preemptions

    reference, _ = collect()
    squeezed, preemptions = collect(max_num_batched_tokens=7, num_kv_blocks=8)
    assert preemptions > 0
    assert squeezed == reference
    assert all(len(sig[0]) == len(p) for sig, p in zip(reference, prompts, strict=True))
