"""The engine's start-up order: the self-check's weightless probes run before the model's weights are
built (their buffers then never add to the model's resident memory), its linears after; the report
holds both."""

from __future__ import annotations

from typing import Any

import pytest

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine import engine as engine_module
from deterministic_inference.engine.engine import Engine
from deterministic_inference.model.loader import load_model
from deterministic_inference.ops.selfcheck import SelfCheck
from tests.tiny_models import TinyModel


def test_weightless_probes_run_before_the_model_is_built(
    tiny_llama_dir: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    build, probe_ops, probe_weights = engine_module.build_model, SelfCheck.probe_ops, SelfCheck.probe_weights

    def record(name: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            events.append(name)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(engine_module, "build_model", record("build", build))
    monkeypatch.setattr(SelfCheck, "probe_ops", record("ops", probe_ops))
    monkeypatch.setattr(SelfCheck, "probe_weights", record("weights", probe_weights))
    engine = Engine(EngineConfig(dtype="float32", threads=1), loaded=load_model(str(tiny_llama_dir.path)))
    assert events[:3] == ["ops", "build", "weights"]
    report = engine.selfcheck_report
    assert report is not None and report.ok, report.table() if report else ""
    assert {r.op for r in report.results} == {"linear", "rms_norm", "silu_mul", "rotary", "attention"}
    assert [r.op for r in report.results][0] == "linear"  # the model's own linears lead the table


def test_no_selfcheck_runs_no_probe(tiny_llama_dir: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a probe ran with selfcheck=False")

    monkeypatch.setattr(SelfCheck, "probe_ops", refuse)
    monkeypatch.setattr(SelfCheck, "probe_weights", refuse)
    loaded = load_model(str(tiny_llama_dir.path))
    assert Engine(EngineConfig(dtype="float32", selfcheck=False), loaded=loaded).selfcheck_report is None
