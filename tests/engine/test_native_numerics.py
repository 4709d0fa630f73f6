"""`--numerics native` (the bf16 GEMM on AMX-BF16 tiles) end to end on a tiny bf16 Llama: a prompt's tokens
and logprob bits do not depend on the batch, its position, chunked prefill, preemption, prefix-cache hits
or threads (greedy and seeded); decode logprobs equal prompt logprobs; the fingerprint records portable
false, the mode and the ISA, while the default keeps its fingerprint. Negative control: the engine on a
kernel build whose GEMM sends a call's partial row tile elsewhere is caught by the same cases. Where the
CPU has no AMX-BF16 the engine refuses the option in one line (tested on every machine by asking for it
on a build without the tiles)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.errors import ConfigError
from deterministic_inference.model.loader import LoadedModel, load_model
from deterministic_inference.ops import backend
from deterministic_inference.ops.native import NativeKernels, load, native_kernels
from deterministic_inference.ops.native_build import build, cache_dir
from tests.engine.test_engine_invariance import (
    CASES,
    GREEDY,
    SEEDED,
    Case,
    Result,
    bits,
    random_prompts,
    result_of,
    run_case,
)
from tests.tiny_models import TinyModel

NATIVE: dict[str, Any] = {"numerics_mode": "native"}


@pytest.fixture(scope="module")
def amx() -> NativeKernels:
    kernels = native_kernels()
    missing = kernels.native_gemm_missing()
    if missing is not None:
        pytest.skip(f"--numerics native cannot run here: {missing}")
    return kernels


@pytest.fixture(scope="module")
def tiny_loaded(tiny_llama_dir: TinyModel) -> LoadedModel:
    return load_model(str(tiny_llama_dir.path))


@pytest.fixture(scope="module")
def tiny_q8_loaded(tiny_llama_gguf_q8: TinyModel) -> LoadedModel:
    return load_model(str(tiny_llama_gguf_q8.path))


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _target(loaded: LoadedModel) -> list[int]:
    return random_prompts(1, loaded.spec.vocab_size, seed=7)[0] + list(range(3, 40))


def _use_ragged_tile_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's kernels replaced by the negative-control build whose AMX GEMM sends a call's partial
    last row tile to the portable path (a row's bits then depend on the batch)."""
    test_builds = cache_dir().parent / "test-builds"  # tests/ops/conftest.py's directory of test-only builds
    ragged = load(build(("-march=native", "-DDETINF_TEST_AMX_RAGGED_OTHER"), test_builds))
    monkeypatch.setattr(backend, "native_kernels", lambda: ragged)


def _differing_cases(loaded: LoadedModel, params: SamplingParams) -> tuple[Result, list[Case], int]:
    """The target alone (one thread) under native numerics, the CASES where it differs, preemptions."""
    target = _target(loaded)
    alone, _ = run_case(loaded, target, params, Case(0, "first", 512, 1), True, "bfloat16", **NATIVE)
    differing, preempted = [], 0
    for case in CASES:
        result, preemptions = run_case(loaded, target, params, case, True, "bfloat16", **NATIVE)
        preempted += preemptions
        if result != alone:
            differing.append(case)
    return alone, differing, preempted


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded-T0.8-p0.9"])
def test_prompt_alone_equals_prompt_in_any_batch(
    amx: NativeKernels, tiny_loaded: LoadedModel, params: SamplingParams, restore_threads: None
) -> None:
    alone, differing, preempted = _differing_cases(tiny_loaded, params)
    assert len(alone.token_ids) == params.max_tokens
    assert differing == []
    assert preempted > 0, "the small-pool case must actually preempt"


def test_negative_control_a_ragged_tile_path_is_caught(
    amx: NativeKernels,
    tiny_loaded: LoadedModel,
    monkeypatch: pytest.MonkeyPatch,
    restore_threads: None,
) -> None:
    """The same cases on a GEMM whose partial last row tile takes the portable path: a row's bits then
    depend on the batch, and the cases must see it (else the test above proves nothing)."""
    _use_ragged_tile_build(monkeypatch)
    _, differing, _ = _differing_cases(tiny_loaded, GREEDY)
    assert differing, "a batch-dependent native GEMM gave identical bits everywhere"


def test_a_quantized_file_runs_on_the_tiles_with_the_same_invariance(
    amx: NativeKernels, tiny_q8_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch, restore_threads: None
) -> None:
    """A Q8_0 GGUF under native numerics: its linears and head run on the tiles as bf16 weights, dequantised
    into them as the GEMM reads them (the fingerprint's weight formats say bf16, the embedding stays as
    stored), and a prompt's bits still do not
    depend on the batch, its position, chunking, preemption or threads; the ragged-tile build is caught
    on this file too."""
    engine = Engine(EngineConfig(dtype="bfloat16", selfcheck=False, **NATIVE), loaded=tiny_q8_loaded)
    assert engine.model.layers[0].qkv.native_gemm and engine.model.layers[0].qkv.backend == "native"
    formats = engine.fingerprint["numerics"]["weight_formats"]
    assert formats["mlp.down_proj.weight"] == "bf16" and formats["model.embed_tokens.weight"] == "q8_0"
    alone, differing, preempted = _differing_cases(tiny_q8_loaded, GREEDY)
    assert len(alone.token_ids) == GREEDY.max_tokens and differing == [] and preempted > 0
    _use_ragged_tile_build(monkeypatch)
    _, differing, _ = _differing_cases(tiny_q8_loaded, GREEDY)
    assert differing, "a batch-dependent native GEMM gave identical bits on the quantized file"


def test_prefix_cache_hits_keep_the_bits(amx: NativeKernels, tiny_loaded: LoadedModel) -> None:
    """A prompt run cold, then again beside prompts sharing its prefix (warm cache: prefix hits)."""
    config = EngineConfig(dtype="bfloat16", selfcheck=False, enable_prefix_caching=True, **NATIVE)
    engine = Engine(config, loaded=tiny_loaded)
    target = _target(tiny_loaded)
    cold = result_of(engine.generate([target], SEEDED)[0])
    neighbours = [target[:35] + [5, 6, 7], target[:20]]
    outputs = engine.generate([*neighbours, target], [GREEDY, GREEDY, SEEDED])
    assert engine.kv.stats.hit_tokens > 0
    assert result_of(outputs[2]) == cold


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_decode_logprobs_equal_prompt_logprobs(
    amx: NativeKernels, tiny_loaded: LoadedModel, params: SamplingParams
) -> None:
    engine = Engine(EngineConfig(dtype="bfloat16", selfcheck=False, **NATIVE), loaded=tiny_loaded)
    prompt = random_prompts(1, tiny_loaded.spec.vocab_size, seed=3)[0] + [5, 6, 7]
    generated = engine.generate([prompt], params)[0].outputs[0]
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=0)
    scored = engine.generate([prompt + generated.token_ids], scoring)[0]
    assert scored.prompt_logprobs is not None
    tail = scored.prompt_logprobs[len(prompt) :]
    assert [bits(v) for v in tail if v is not None] == [bits(v) for v in generated.logprobs]


def test_native_changes_the_numbers_and_the_fingerprint_default_keeps_it(
    amx: NativeKernels, tiny_loaded: LoadedModel
) -> None:
    target = _target(tiny_loaded)
    engines = {
        mode: Engine(EngineConfig(dtype="bfloat16", numerics_mode=mode), loaded=tiny_loaded)  # self-check on
        for mode in ("portable", "native")
    }
    results = {mode: result_of(engine.generate([target], GREEDY)[0]) for mode, engine in engines.items()}
    assert results["native"].logprob_bits != results["portable"].logprob_bits
    portable, native = (engines[mode].fingerprint["numerics"] for mode in ("portable", "native"))
    assert portable["portable"] is True and "numerics_mode" not in portable and "isa" not in portable
    assert native["portable"] is False and native["numerics_mode"] == "native"
    assert native["isa"]["cpu"]["amx_bf16"] is True
    assert engines["portable"].system_fingerprint != engines["native"].system_fingerprint
    default = Engine(EngineConfig(dtype="bfloat16", selfcheck=False), loaded=tiny_loaded)
    assert default.fingerprint == engines["portable"].fingerprint
    report = engines["native"].selfcheck_report
    assert report is not None and report.ok
    assert any("AMX-BF16" in result.shape and "16" in result.detail for result in report.results)


def test_a_cpu_without_amx_bf16_refuses_native_in_one_line(
    tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The AVX2 build stands in for a CPU without the tiles: ConfigError naming --numerics and the CPU
    feature, before anything is served (never the portable GEMM in silence)."""
    avx2 = load(build(("-march=x86-64-v3",)))
    monkeypatch.setattr(backend, "native_kernels", lambda: avx2)
    with pytest.raises(ConfigError) as caught:
        Engine(EngineConfig(dtype="bfloat16", **NATIVE), loaded=tiny_loaded)
    message = str(caught.value)
    assert "--numerics native" in message and "AMX-BF16" in message and "\n" not in message


def test_native_with_plain_torch_ops_is_refused() -> None:
    with pytest.raises(ConfigError, match="--numerics native.*--no-batch-invariant"):
        EngineConfig(batch_invariant=False, **NATIVE)
    with pytest.raises(ConfigError, match="--numerics: 'fast' is not one of portable, native"):
        EngineConfig(numerics_mode="fast")
