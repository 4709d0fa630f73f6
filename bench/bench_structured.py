"""Structured outputs on the default model: JSON-schema requests vs the same requests unconstrained, the
mask fill beside the forward pass vs inline, and grammar compile times.

Run by hand:  .venv/bin/python -m bench.bench_structured [--streams 1 32] [--threads 1] [--max-tokens 64]

Every constrained request uses a schema whose answers never end before `--max-tokens` (an array of at
least 100 records), so constrained and unconstrained runs generate the same number of tokens and the
tokens/s ratio is the cost of the masks alone. After a warm-up the three configurations (unconstrained,
constrained with the fill overlapped, constrained with the fill inline) run `--repeats` times,
interleaved; the medians are printed. Compile
times are for a fresh compiler (no cache) and then the cached lookup.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Mapping
from concurrent.futures import Future

import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.grammar import GrammarCompiler
from deterministic_inference.engine.grammar_state import (
    MaskFiller,
    PendingMasks,
    constrained_rows,
    fill_masks,
)
from deterministic_inference.engine.plan import StepPlan
from deterministic_inference.engine.request import Request
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.engine.structured_spec import StructuredOutput
from deterministic_inference.model.loader import load_model

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "email", "tags"],
    "additionalProperties": False,
}
LONG = {"type": "array", "items": RECORD, "minItems": 100}  # never finishes within max_tokens


def large_schema(properties: int = 300) -> dict[str, object]:
    """A large schema (~60 KB): many typed, patterned and nested properties."""
    props: dict[str, object] = {}
    for i in range(properties):
        kind = i % 4
        if kind == 0:
            props[f"field_{i}"] = {"type": "string", "pattern": f"^[a-z]{{1,{i % 9 + 3}}}-{i}$"}
        elif kind == 1:
            props[f"field_{i}"] = {"type": "integer", "minimum": -i, "maximum": 1000 + i}
        elif kind == 2:
            props[f"field_{i}"] = {"enum": [f"v{i}_{j}" for j in range(6)]}
        else:
            props[f"field_{i}"] = {"type": "array", "items": RECORD, "maxItems": 4}
    return {
        "type": "object",
        "properties": props,
        "required": list(props)[:50],
        "additionalProperties": False,
    }


class InlineMaskFiller(MaskFiller):
    """The masks filled on the engine thread before the forward pass (no overlap), for comparison."""

    def start(self, plan: StepPlan, sequences: Mapping[str, Request]) -> PendingMasks | None:
        rows = constrained_rows(plan, sequences)
        if not rows:
            return None
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        done: Future = Future()
        done.set_result(fill_masks(rows, self.vocab_size, self._executor))
        return PendingMasks([s.request_id for s in rows], done)


def tokens_per_second(engine: Engine, prompts: list[str], params: SamplingParams) -> tuple[float, int]:
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens / elapsed, tokens


def compile_times(compiler: GrammarCompiler, schema: dict[str, object]) -> tuple[float, float, int]:
    spec = StructuredOutput("json_schema", json.dumps(schema, sort_keys=True, separators=(",", ":")))
    start = time.perf_counter()
    compiler.compile(spec)
    first = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile(spec)
    return first, time.perf_counter() - start, len(spec.source)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(None)
    engine = Engine(EngineConfig(selfcheck=False, threads=args.threads), loaded=loaded)
    for label, schema in (("typical", RECORD), ("large", large_schema())):
        fresh = GrammarCompiler(engine.tokenizer, engine.spec.vocab_size)
        first, cached, size = compile_times(fresh, schema)
        print(f"compile {label} schema ({size} bytes): {first * 1000:.1f} ms; cached {cached * 1e6:.0f} us")
    spec = StructuredOutput("json_schema", json.dumps(LONG, sort_keys=True, separators=(",", ":")))
    plain = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=1, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=1, structured_output=spec)
    engine.generate([f"warm-up {i}" for i in range(2)], [plain, constrained])
    overlapped = engine.runner.masks
    print("streams | unconstrained tok/s | constrained tok/s (overlap) | constrained (inline) | ratio | gain")
    for streams in args.streams:
        asks = [[{"role": "user", "content": f"List people as JSON, batch {i}."}] for i in range(streams)]
        prompts = [engine.tokenizer.apply_chat_template(messages) for messages in asks]
        runs: dict[str, list[float]] = {"free": [], "overlap": [], "inline": []}
        for _ in range(args.repeats):  # interleaved, so load changes hit every configuration alike
            for name, params, filler in (
                ("free", plain, overlapped),
                ("overlap", constrained, overlapped),
                ("inline", constrained, InlineMaskFiller(engine.spec.vocab_size)),
            ):
                engine.runner.masks = filler
                rate, tokens = tokens_per_second(engine, prompts, params)
                assert tokens == streams * args.max_tokens
                runs[name].append(rate)
        engine.runner.masks = overlapped
        free, masked, inline = (statistics.median(runs[k]) for k in ("free", "overlap", "inline"))
        ratio, gain = masked / free, masked / inline
        print(f"{streams} | {free:.1f} | {masked:.1f} | {inline:.1f} | {ratio:.2f}x | {gain:.2f}x")
        print(f"   runs: {json.dumps({k: [round(v, 1) for v in r] for k, r in runs.items()})}")

if __name__ == "__main__":
    main()
