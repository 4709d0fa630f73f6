"""Long contexts: prefill tokens/s of 0.5k / 2k / 6k-token prompts and decode tokens/s at 6k context, our
engine vs llama.cpp (llama-cpp-python) on the same GGUF (the default model's file) and thread count.

Run by hand from the repository root (not a test); llama.cpp runs in a bench-only venv:
  python3.11 -m venv $BENCH_VENV && $BENCH_VENV/bin/pip install -r bench/requirements-bench.txt
  .venv/bin/python -m bench.bench_long_context --llama-python $BENCH_VENV/bin/python [--threads 1 2]
Each repeat runs our engine over every length, then llama.cpp (a child process of the bench venv's
Python) over the same lengths, so both see the same machine load; the medians are reported with their
ratio. Prompts are random token ids (a fixed seed per length and repeat), so no prefix cache can help.
Prefill tokens/s = prompt tokens / time to the first token; decode tokens/s = tokens after the first /
the time they took, generated greedily after the 6k-token prompt.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

LENGTHS = (512, 2048, 6144)
DECODE_TOKENS = 64
N_CTX = 8192
FIRST_ID = 100  # random prompt ids from here to the vocabulary's end (skips the special tokens)


def prompt(length: int, vocab: int, repeat: int) -> list[int]:
    rng = random.Random(length * 1000 + repeat)
    return [rng.randrange(FIRST_ID, vocab) for _ in range(length)]


def ours(threads: int, repeat: int) -> dict[str, float]:
    """Our engine (invariant mode, default config) -> {"prefill <n>": tok/s, ..., "decode 6144": tok/s}."""
    import torch

    from deterministic_inference.config import EngineConfig
    from deterministic_inference.engine.engine import Engine
    from deterministic_inference.engine.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    engine = Engine(EngineConfig(threads=threads, selfcheck=False, enable_prefix_caching=False))
    vocab = engine.spec.vocab_size
    engine.generate([prompt(16, vocab, -1)], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    rates: dict[str, float] = {}
    for length in LENGTHS:
        decode = DECODE_TOKENS if length == LENGTHS[-1] else 1
        params = SamplingParams(max_tokens=decode, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        first = end = 0.0
        for output in engine.stream(prompt(length, vocab, repeat), params):
            end = time.perf_counter()
            if output.outputs[0].token_ids and not first:
                first = end  # the prompt's prefill is done
        rates[f"prefill {length}"] = length / (first - start)
        if decode > 1:
            rates[f"decode {length}"] = (decode - 1) / (end - first)
    return rates


def llama_cpp(model: str, threads: int, repeat: int) -> dict[str, float]:
    """llama.cpp on the same file: eval of the prompt (batches of 512), then one token at a time."""
    import llama_cpp as llama_cpp_module

    llm = llama_cpp_module.Llama(
        model_path=model, n_ctx=N_CTX, n_threads=threads, n_threads_batch=threads, verbose=False
    )
    vocab = llm.n_vocab()
    llm.eval(prompt(16, vocab, -1))  # warm-up
    rates: dict[str, float] = {}
    for length in LENGTHS:
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt(length, vocab, repeat))
        first = time.perf_counter()
        rates[f"prefill {length}"] = length / (first - start)
        if length == LENGTHS[-1]:
            for _ in range(DECODE_TOKENS - 1):
                llm.eval([FIRST_ID])
            rates[f"decode {length}"] = (DECODE_TOKENS - 1) / (time.perf_counter() - first)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--llama-python", default=sys.executable, help="Python with llama-cpp-python")
    parser.add_argument("--worker", choices=["llama"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "llama":
        print(json.dumps(llama_cpp(args.model, args.threads[0], args.repeat)))
        return
    from deterministic_inference.model.default_model import default_model_path

    model = str(default_model_path())
    script = str(Path(__file__).resolve())
    for threads in args.threads:
        results: dict[str, dict[str, list[float]]] = {"detinf": {}, "llama.cpp": {}}
        for repeat in range(args.repeats):
            worker = [args.llama_python, script, "--worker", "llama", "--model", model]
            worker += ["--threads", str(threads), "--repeat", str(repeat)]
            peer = subprocess.run(worker, capture_output=True, text=True, check=True)
            runs = {"detinf": ours(threads, repeat), "llama.cpp": json.loads(peer.stdout)}
            for impl, rates in runs.items():
                for key, value in rates.items():
                    results[impl].setdefault(key, []).append(value)
        print(f"threads {threads}, repeats {args.repeats} (median tok/s; runs)")
        for key in results["detinf"]:
            mine, theirs = (statistics.median(results[impl][key]) for impl in ("detinf", "llama.cpp"))
            runs_text = {impl: [round(v, 1) for v in results[impl][key]] for impl in results}
            print(f"  {key:<14} detinf {mine:8.1f} llama.cpp {theirs:8.1f} {mine / theirs:.2f}x {runs_text}")


if __name__ == "__main__":
    main()
