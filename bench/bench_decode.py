"""Single-stream decode, our engine vs llama.cpp on the same GGUF files, threads 1 and 2, in one run.

Run by hand from the repository root (llama.cpp runs in a child process under the bench venv's Python,
see bench/llama_cpp_worker.py); the 1B files come from the model maker:
    .venv/bin/python -m bench.make_gguf --out /tmp/llama1b-Q4_0.gguf --qtype Q4_0
    .venv/bin/python -m bench.make_gguf --out /tmp/llama1b-Q8_0.gguf --qtype Q8_0
    .venv/bin/python -m bench.bench_decode --model default --model /tmp/llama1b-Q4_0.gguf \
        --model /tmp/llama1b-Q8_0.gguf [--threads 1 2] [--output-len 64] [--repeats 3]

Both generate greedily from the same prompt with end-of-sequence banned (ours: ignore_eos; llama.cpp: a
-1e9 logit bias on its eos id) for `--output-len` tokens, each request from an empty cache (ours: the
prefix cache flushed; llama.cpp: `reset`, since llama-cpp-python would otherwise reuse the last request's
prompt and skip its prefill). Two rates per request: tokens / wall time of the request (the prompt's
prefill included), and decode = the tokens after the first / the time after the first token. Our run and
llama.cpp's alternate, so both see the same load on this shared machine; the ratios of the medians are
the figures to read. Also printed: llama.cpp's peak RSS after its runs (a fresh worker per model).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch

from bench.llama_cpp_worker import DEFAULT_PYTHON, LlamaCppWorker

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
MB = 1 << 20


class Rates(NamedTuple):
    """One request's rates: tokens / wall time with the prefill, and decode tokens/s after the first token."""

    request: float
    decode: float

    @classmethod
    def of(cls, tokens: int, seconds: float, first_token_seconds: float) -> Rates:
        return cls(tokens / seconds, (tokens - 1) / (seconds - first_token_seconds))


def our_run(engine: object, threads: int, output_len: int) -> Rates:
    """One greedy request of `output_len` tokens on our engine, from an empty prefix cache."""
    from deterministic_inference.engine.engine import Engine
    from deterministic_inference.engine.sampling_params import SamplingParams

    assert isinstance(engine, Engine)
    torch.set_num_threads(threads)
    engine.flush_prefix_cache()
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    request_id = engine.add_request(PROMPT, params)
    first, tokens = 0.0, 0
    while engine.has_unfinished:
        for delta in engine.step_deltas():
            tokens += sum(len(choice.token_ids) for choice in delta.outputs)
            if not first and tokens:
                first = time.perf_counter() - start
    seconds = time.perf_counter() - start
    engine.release(request_id)
    return Rates.of(tokens, seconds, first)


def _row(name: str, threads: int, ours: list[Rates], theirs: list[Rates], peak: int) -> str:
    mine = Rates(*(statistics.median(values) for values in zip(*ours, strict=True)))
    reference = Rates(*(statistics.median(values) for values in zip(*theirs, strict=True)))
    runs = f"{[round(r.request, 1) for r in ours]} / {[round(r.request, 1) for r in theirs]}"
    return (
        f"| {name} | {threads} | {mine.request:.1f} | {reference.request:.1f} | "
        f"**{mine.request / reference.request:.2f}x** | {mine.decode:.1f} | {reference.decode:.1f} | "
        f"**{mine.decode / reference.decode:.2f}x** | {runs} | {peak / MB:.0f} MB |"
    )


def compare(model: str, threads: int, output_len: int, repeats: int, python: str) -> str:
    """One table row: medians of alternating runs of ours and llama.cpp's on `model` at `threads`."""
    from deterministic_inference.config import EngineConfig
    from deterministic_inference.engine.engine import Engine

    engine = Engine(EngineConfig(model=model, threads=threads, selfcheck=False, kv_cache_memory=256 * MB))
    worker = LlamaCppWorker(python)
    try:
        worker.request(op="load", model=model, threads=threads, n_ctx=1024)
        our_run(engine, threads, 4)  # warm-up: the file's pages, the kernels' first calls
        worker.request(op="generate", prompt=PROMPT, max_tokens=4)
        ours: list[Rates] = []
        theirs: list[Rates] = []
        for _ in range(repeats):
            ours.append(our_run(engine, threads, output_len))
            answer = worker.request(op="generate", prompt=PROMPT, max_tokens=output_len)
            theirs.append(Rates.of(answer["tokens"], answer["seconds"], answer["first_token_seconds"]))
        peak = worker.request(op="rss")["peak"]
    finally:
        worker.close()
    return _row(Path(model).name, threads, ours, theirs, peak)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", action="append", help="GGUF file, or 'default' (repeatable)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--llama-python", default=str(DEFAULT_PYTHON), help="a Python with llama_cpp")
    args = parser.parse_args()
    from deterministic_inference.model.default_model import default_model_path

    models = [str(default_model_path()) if m == "default" else m for m in (args.model or ["default"])]
    worker = LlamaCppWorker(args.llama_python)
    try:
        info = worker.request(op="load", model=models[0], threads=1, n_ctx=64)
    finally:
        worker.close()
    print(f"llama-cpp-python {info['version']}: {info['system_info'].strip()}")
    print(f"output {args.output_len} tokens, repeats {args.repeats}, load average {os.getloadavg()[0]:.1f}")
    columns = (
        *("model", "threads", "detinf tok/s", "llama.cpp tok/s", "ratio", "detinf decode"),
        *("llama.cpp decode", "decode ratio", "runs, tok/s (ours / llama.cpp)", "llama.cpp peak RSS"),
    )
    print(f"| {' | '.join(columns)} |")
    print(f"|{'---|' * len(columns)}")
    for model in models:
        for threads in args.threads:
            print(compare(model, threads, args.output_len, args.repeats, args.llama_python), flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
