"""Single-stream decode, our engine vs llama.cpp on the same GGUF files, threads 1 and 2, in one run.

Run by hand from the repository root (llama.cpp runs in a child process under the bench venv's Python,
see bench/llama_cpp_worker.py); the 1B files come from the model maker:
    .venv/bin/python -m bench.make_gguf --out /tmp/llama1b-Q4_0.gguf --qtype Q4_0
    .venv/bin/python -m bench.make_gguf --out /tmp/llama1b-Q8_0.gguf --qtype Q8_0
    .venv/bin/python -m bench.bench_decode --model default --model /tmp/llama1b-Q4_0.gguf \
        --model /tmp/llama1b-Q8_0.gguf [--threads 1 2] [--output-len 64] [--repeats 3]

Both generate greedily from the same prompt with end-of-sequence banned (ours: ignore_eos; llama.cpp: a
-1e9 logit bias on its eos id) for `--output-len` tokens; tokens/s = generated tokens / wall time of the
request (the 18-token prefill included, for both). Our run and llama.cpp's alternate, so both see the
same load on this shared machine; the ratio of the medians is the figure to read. Also printed: each
side's peak RSS after its runs (ours: this process, so the largest model's; llama.cpp's: a fresh worker
per model).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from bench.llama_cpp_worker import DEFAULT_PYTHON, LlamaCppWorker

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
MB = 1 << 20


def our_rate(engine: object, threads: int, output_len: int) -> float:
    """Tokens/s of one greedy request of `output_len` tokens on our engine."""
    from deterministic_inference.engine.engine import Engine
    from deterministic_inference.engine.sampling_params import SamplingParams

    assert isinstance(engine, Engine)
    torch.set_num_threads(threads)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    output = engine.generate([PROMPT], params)[0]
    return len(output.outputs[0].token_ids) / (time.perf_counter() - start)


def compare(model: str, threads: int, output_len: int, repeats: int, python: str) -> str:
    """One table row: medians of alternating runs of ours and llama.cpp's on `model` at `threads`."""
    from deterministic_inference.config import EngineConfig
    from deterministic_inference.engine.engine import Engine

    engine = Engine(EngineConfig(model=model, threads=threads, selfcheck=False, kv_cache_memory=256 * MB))
    worker = LlamaCppWorker(python)
    try:
        worker.request(op="load", model=model, threads=threads, n_ctx=1024)
        our_rate(engine, threads, 4)  # warm-up: the file's pages, the kernels' first calls
        worker.request(op="generate", prompt=PROMPT, max_tokens=4)
        ours: list[float] = []
        theirs: list[float] = []
        for _ in range(repeats):
            ours.append(our_rate(engine, threads, output_len))
            answer = worker.request(op="generate", prompt=PROMPT, max_tokens=output_len)
            theirs.append(answer["tokens"] / answer["seconds"])
        peak = worker.request(op="rss")["peak"]
    finally:
        worker.close()
    mine, reference = statistics.median(ours), statistics.median(theirs)
    runs = f"{[round(v, 1) for v in ours]} / {[round(v, 1) for v in theirs]}"
    return (
        f"| {Path(model).name} | {threads} | {mine:.1f} | {reference:.1f} | **{mine / reference:.2f}x** | "
        f"{runs} | {peak / MB:.0f} MB |"
    )


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
    columns = ("model", "threads", "detinf tok/s", "llama.cpp tok/s", "ratio", "runs (ours / llama.cpp)")
    print(f"| {' | '.join(columns)} | llama.cpp peak RSS |")
    print("|---|---|---|---|---|---|---|")
    for model in models:
        for threads in args.threads:
            print(compare(model, threads, args.output_len, args.repeats, args.llama_python), flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
