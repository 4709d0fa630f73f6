"""AsyncEngine: one engine thread, bounded admission, cancellation, failure surfacing, draining."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.async_engine import (
    AsyncEngine,
    EngineNotReadyError,
    EngineState,
    QueueFullError,
)
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.faults import FaultInjection
from deterministic_inference.engine.outputs import RequestOutput
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.errors import EngineDeadError, InvalidRequestError, ModelLoadError
from tests.server.harness import tiny_config
from tests.tiny_models import TinyModel

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
TIMEOUT = 60.0


def failing_engine(config: EngineConfig) -> Engine:
    """A real engine whose fourth step raises (fault injection, not a mock)."""
    return Engine(config, faults=FaultInjection(fail_step=3))


def run(coro_factory: Callable[[], Any]) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro_factory(), TIMEOUT)

    return asyncio.run(bounded())


def make(
    config: EngineConfig, capacity: int = 8, build: Callable[[EngineConfig], Engine] = Engine
) -> AsyncEngine:
    return AsyncEngine(lambda: build(config), capacity)


async def collect(engine: AsyncEngine, prompt: str, params: SamplingParams) -> list[RequestOutput]:
    return [output async for output in engine.generate(prompt, params)]


def test_generate_matches_offline_engine(tiny_llama_dir: TinyModel) -> None:
    config = tiny_config(tiny_llama_dir)
    offline = Engine(config).generate(["Hello", "Numbers 0123"], GREEDY)

    async def main() -> list[list[RequestOutput]]:
        engine = make(config)
        engine.start()
        await engine.wait_ready(TIMEOUT)
        try:
            return list(
                await asyncio.gather(
                    collect(engine, "Hello", GREEDY), collect(engine, "Numbers 0123", GREEDY)
                )
            )
        finally:
            await engine.stop()

    streams = run(main)
    for outputs, reference in zip(streams, offline, strict=True):
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        assert outputs[-1].outputs[0].token_ids == reference.outputs[0].token_ids
        assert outputs[-1].outputs[0].logprobs == reference.outputs[0].logprobs


def test_capacity_cancel_and_invalid_requests(tiny_llama_dir: TinyModel) -> None:
    async def main() -> dict[str, Any]:
        engine = make(tiny_config(tiny_llama_dir), capacity=1)
        engine.start()
        await engine.wait_ready(TIMEOUT)
        try:
            with pytest.raises(InvalidRequestError):
                await engine.add([0, 10**6], GREEDY)  # token id outside the vocabulary
            stream = await engine.add("Hello", LONG)
            with pytest.raises(QueueFullError):
                await engine.add("Hello", GREEDY)
            with pytest.raises(InvalidRequestError):
                await engine.add("Hello", SamplingParams(n=2))  # more sequences than the capacity
            async for delta in stream.deltas():
                if delta.outputs and delta.outputs[0].token_ids:
                    break
            stream.close()  # abort mid-generation
            for _ in range(200):
                stats = engine.stats()
                if stats["kv_blocks_used"] == 0 and stats["num_running"] == 0:
                    break
                await asyncio.sleep(0.05)
            again = await collect(engine, "Hello", GREEDY)  # the slot is free again
            return {"stats": engine.stats(), "again": again}
        finally:
            await engine.stop()

    result = run(main)
    assert result["stats"]["kv_blocks_used"] == 0
    assert result["stats"]["num_inflight_sequences"] == 0
    assert result["again"][-1].finished


def test_engine_failure_fails_inflight_requests_without_hanging(tiny_llama_dir: TinyModel) -> None:
    async def main() -> AsyncEngine:
        engine = make(tiny_config(tiny_llama_dir), build=failing_engine)
        engine.start()
        await engine.wait_ready(TIMEOUT)
        results = await asyncio.gather(
            collect(engine, "Hello", LONG), collect(engine, "Grüße", LONG), return_exceptions=True
        )
        assert all(isinstance(r, EngineDeadError) for r in results), results
        with pytest.raises(EngineDeadError):
            await engine.add("Hello", GREEDY)
        await engine.stop()  # returns: the thread has exited
        return engine

    engine = run(main)
    assert engine.state is EngineState.FAILED
    assert engine.error is not None and "injected engine fault" in engine.error
    assert engine.public_error is not None and "InjectedFault" in engine.public_error


def test_load_failure_is_reported(tmp_path: Any) -> None:
    async def main() -> AsyncEngine:
        engine = make(EngineConfig(model=str(tmp_path / "missing")))
        failures: list[str] = []
        engine.on_load_failure = failures.append
        engine.start()
        with pytest.raises(EngineNotReadyError):
            await engine.wait_ready(TIMEOUT)
        await asyncio.sleep(0.05)  # let the callback run
        assert failures
        with pytest.raises(EngineDeadError):
            await engine.add("Hello", GREEDY)
        await engine.stop()
        return engine

    engine = run(main)
    assert engine.state is EngineState.FAILED
    assert engine.error is not None and ModelLoadError.__name__ in engine.error


def test_stop_drains_inflight_requests(tiny_llama_dir: TinyModel) -> None:
    async def main() -> tuple[RequestOutput, AsyncEngine]:
        engine = make(tiny_config(tiny_llama_dir))
        engine.start()
        await engine.wait_ready(TIMEOUT)
        stream = await engine.add("Hello", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
        stopping = asyncio.create_task(engine.stop())
        await asyncio.sleep(0)
        with pytest.raises(EngineNotReadyError):
            await engine.add("Hello", GREEDY)  # no new requests while draining
        output = await stream.result()
        assert await stopping
        return output, engine

    output, engine = run(main)
    assert output.finished and len(output.outputs[0].token_ids) == 20
    assert engine.state is EngineState.STOPPED
