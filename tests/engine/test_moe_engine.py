"""Engine-level invariance of mixture-of-experts models (tiny random Qwen3-MoE: 8 experts, top-3).

Bitwise, as for the dense models: a prompt alone vs inside batches of up to 32 mixed prompts (so every
expert's load differs), with chunked prefill, 1 vs 2 threads and preemption, greedy and seeded; prefix-cache
hits; a router with constructed ties. Negative control: summing each token's expert outputs in an order
that depends on the experts' loads in the batch must change some result, and the start-up self-check
must name the MoE block.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.errors import SelfCheckError
from deterministic_inference.model.loader import LoadedModel, load_model
from deterministic_inference.model.moe import MoEBlock
from tests.engine.test_engine_invariance import CASES, GREEDY, SEEDED, Case, random_prompts, run_case
from tests.engine.test_prefix_cache_engine import run_batches, shared_prefix_prompts
from tests.moe_models import write_moe_gguf
from tests.tiny_models import TinyModel


@pytest.fixture(scope="module")
def moe_fp32(tiny_qwen3_moe_dir: TinyModel) -> LoadedModel:
    return load_model(str(tiny_qwen3_moe_dir.path))


@pytest.fixture(scope="module")
def moe_q4_0(tiny_qwen3_moe_dir: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = tmp_path_factory.mktemp("moe-q4") / "tiny-qwen3-moe.Q4_0.gguf"
    return load_model(str(write_moe_gguf(tiny_qwen3_moe_dir, path, quant="Q4_0")))


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def load_dependent_order(
    self: MoEBlock, ids: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The broken order of the negative controls: each token's experts summed busiest first, where
    "busiest" counts the tokens of the whole batch routed to each expert."""
    load = torch.bincount(ids.reshape(-1), minlength=len(self.experts))  # [E]
    order = (ids - load[ids] * len(self.experts)).argsort(dim=1)  # by (-load, expert index)
    return ids.gather(1, order), weights.gather(1, order)


@pytest.fixture
def load_dependent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(MoEBlock, "summation_order", load_dependent_order)


# chunked prefill with 8 others and 2 threads; 32 others, 2 threads; 16 others with preemption (the
# prompt alone runs with 1 thread, unchunked)
MOE_CASES = [CASES[1], CASES[2], CASES[4]]


def target_prompt(loaded: LoadedModel) -> list[int]:
    return random_prompts(1, loaded.spec.vocab_size, seed=7)[0] + list(range(3, 40))


@pytest.mark.parametrize(
    ("fixture", "dtype", "params"),
    [("moe_fp32", "float32", GREEDY), ("moe_q4_0", "bfloat16", SEEDED)],
    ids=["hf-fp32-greedy", "gguf-q4_0-bf16-seeded"],
)
def test_prompt_alone_equals_prompt_in_any_batch(
    fixture: str, dtype: str, params: object, request: pytest.FixtureRequest, restore_threads: None
) -> None:
    loaded: LoadedModel = request.getfixturevalue(fixture)
    target = target_prompt(loaded)
    alone, _ = run_case(loaded, target, params, Case(0, "first", 512, 1), True, dtype)  # type: ignore[arg-type]
    assert len(alone.token_ids) == GREEDY.max_tokens
    preempted = 0
    for case in MOE_CASES:
        result, preemptions = run_case(loaded, target, params, case, True, dtype)  # type: ignore[arg-type]
        preempted += preemptions
        assert result == alone, f"differs in {case}"
    assert preempted > 0, "the small-pool case must actually preempt"


def test_negative_control_load_dependent_expert_order_differs(
    moe_fp32: LoadedModel, load_dependent: None, restore_threads: None
) -> None:
    target = target_prompt(moe_fp32)
    alone, _ = run_case(moe_fp32, target, GREEDY, Case(0, "first", 512, 1), True, "float32")
    differs = (run_case(moe_fp32, target, GREEDY, case, True, "float32")[0] != alone for case in MOE_CASES)
    assert any(differs), "a load-dependent expert order gave identical bits everywhere: the tests cannot fail"


def test_selfcheck_probes_moe_and_catches_a_load_dependent_order(
    moe_q4_0: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = Engine(EngineConfig(threads=2, dtype="float32"), loaded=moe_q4_0).selfcheck_report
    assert report is not None and report.ok, report and report.table()
    probed = {(r.op, r.shape.split(" ")[0]) for r in report.results}
    assert ("moe", "[M,") in probed and ("moe_route", "[M,") in probed
    shapes = " ".join(r.shape for r in report.results if r.op == "linear")
    assert "router 64->8 fp32->fp32" in shapes and "expert_gate_up 64->64" in shapes and "q4_0" in shapes
    monkeypatch.setattr(MoEBlock, "summation_order", load_dependent_order)
    with pytest.raises(SelfCheckError, match=r"moe \[M, 64\] 8 experts top-3"):
        Engine(EngineConfig(threads=2, dtype="float32"), loaded=moe_q4_0)


def test_prefix_cache_hits_equal_misses(moe_q4_0: LoadedModel) -> None:
    prompts = shared_prefix_prompts(6, prefix_len=70)
    uncached = Engine(EngineConfig(selfcheck=False, enable_prefix_caching=False), loaded=moe_q4_0)
    reference = run_batches(uncached, prompts, 6)
    engine = Engine(EngineConfig(selfcheck=False), loaded=moe_q4_0)
    cold, warm = run_batches(engine, prompts, 3), run_batches(engine, prompts, 2)
    assert engine.kv.stats.hit_tokens > 0
    assert cold == reference and warm == reference


def tied_router(loaded: LoadedModel) -> LoadedModel:
    """The model with every layer's router rows 2 and 5 equal to row 1 (experts 1, 2, 5 always tie)."""
    weights = dict(loaded.weights)
    for layer in range(loaded.spec.num_layers):
        name = f"model.layers.{layer}.mlp.gate.weight"
        router = weights[name].clone()  # type: ignore[union-attr]
        router[2] = router[5] = router[1]
        weights[name] = router
    return LoadedModel(loaded.spec, weights, loaded.tokenizer, loaded.artifacts, loaded.source, loaded.name)


def test_constructed_router_ties_are_broken_by_index_in_any_batch(
    moe_fp32: LoadedModel, restore_threads: None
) -> None:
    tied = tied_router(moe_fp32)
    engine = Engine(EngineConfig(dtype="float32", selfcheck=False), loaded=tied)
    block = engine.model.layers[0].mlp
    assert isinstance(block, MoEBlock)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    ids, _ = engine.model.ops.moe_route(block.router(x), 3, True)
    chose_tied = ids[(ids == 1).any(dim=1) | (ids == 2).any(dim=1) | (ids == 5).any(dim=1)]
    assert len(chose_tied) > 0
    for row in chose_tied.tolist():  # of the tied experts, the lowest indices are taken first
        taken = [e for e in row if e in (1, 2, 5)]
        assert taken == [1, 2, 5][: len(taken)]
    target = target_prompt(tied)
    alone, _ = run_case(tied, target, GREEDY, Case(0, "first", 512, 1), True)
    for case in (CASES[1], CASES[2]):
        assert run_case(tied, target, GREEDY, case, True)[0] == alone, f"differs in {case}"


def test_fingerprint_names_the_expert_formats(moe_q4_0: LoadedModel, tmp_path: Path) -> None:
    numerics = Engine(EngineConfig(selfcheck=False), loaded=moe_q4_0).fingerprint["numerics"]
    formats = numerics["weight_formats"]
    assert formats["mlp.experts.down_proj.weight"] == "q4_0"  # one class for every expert
    assert formats["mlp.gate.weight"] in ("bf16", "f32")
