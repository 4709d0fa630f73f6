"""Mixture-of-experts decode speed and memory: our engine vs llama.cpp on the same GGUF, 1 and N streams.

    .venv/bin/python -m bench.bench_moe --model /tmp/moe-q4_0.gguf [--llama-python $BENCH_VENV/bin/python]

Make the file with `python -m bench.make_gguf --out /tmp/moe-q4_0.gguf --qtype Q4_0 --experts 8
--experts-used 2 --ffn 2048`; llama-cpp-python lives in a separate venv (bench/requirements-bench.txt),
whose interpreter runs the llama.cpp side. Every measurement is a fresh process (ours and llama.cpp
alternating, so both see the same machine load), reporting generated tokens / wall time of the whole
run (prefill of every stream included) and its peak RSS (ru_maxrss). Prompts are the same random token
ids on both sides; greedy; eos ignored. llama.cpp runs its streams as parallel sequences of one
context (llama_batch with one seq_id per stream), one decode call per step for all streams.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.llama_cpp_worker import DEFAULT_PYTHON


def make_prompts(streams: int, length: int, seed: int = 0) -> list[list[int]]:
    """The same token ids in both processes (plain `random`: the llama.cpp side has no torch)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(streams)]


def run_ours(model: str, prompts: list[list[int]], output_len: int, threads: int, invariant: bool) -> float:
    """tokens/s of one `Engine.generate` over every prompt (bf16, self-check off: it is a start-up cost)."""
    from deterministic_inference.config import EngineConfig
    from deterministic_inference.engine.engine import Engine
    from deterministic_inference.engine.sampling_params import SamplingParams

    config = EngineConfig(
        model=model, threads=threads, selfcheck=False, batch_invariant=invariant, kv_cache_memory=1 << 30
    )
    engine = Engine(config)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def run_llama_cpp(model: str, prompts: list[list[int]], output_len: int, threads: int) -> float:
    """tokens/s of llama.cpp decoding every prompt as one sequence of a shared context, greedy."""
    import llama_cpp as lc

    lc.llama_backend_init()
    llama_model = lc.llama_model_load_from_file(model.encode(), lc.llama_model_default_params())
    params = lc.llama_context_default_params()
    streams, prompt_len = len(prompts), len(prompts[0])
    params.n_ctx = streams * (prompt_len + output_len + 16)
    params.n_batch = params.n_ubatch = max(512, streams * prompt_len)
    params.n_seq_max = streams
    params.n_threads = params.n_threads_batch = threads
    ctx = lc.llama_init_from_model(llama_model, params)
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(llama_model))
    batch = lc.llama_batch_init(params.n_batch, 0, 1)
    start = time.perf_counter()
    items = [(p[i], i, s, i == len(p) - 1) for s, p in enumerate(prompts) for i in range(len(p))]
    generated = 0
    for step in range(output_len):
        _fill(batch, items)
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        position = prompt_len + step
        next_items = []
        for row in range(streams):  # the outputs are the flagged tokens in batch order (-1: the last)
            token = _argmax(lc.llama_get_logits_ith(ctx, row - streams), vocab)
            next_items.append((token, position, row, True))
        generated += streams
        items = next_items
    elapsed = time.perf_counter() - start
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(llama_model)
    return generated / elapsed


def _fill(batch: object, items: list[tuple[int, int, int, bool]]) -> None:
    """(token, position, sequence, wants logits) rows into a llama_batch."""
    b = batch  # llama_cpp.llama_batch
    for i, (token, position, seq, logits) in enumerate(items):
        b.token[i] = token  # type: ignore[attr-defined]
        b.pos[i] = position  # type: ignore[attr-defined]
        b.n_seq_id[i] = 1  # type: ignore[attr-defined]
        b.seq_id[i][0] = seq  # type: ignore[attr-defined]
        b.logits[i] = logits  # type: ignore[attr-defined]
    b.n_tokens = len(items)  # type: ignore[attr-defined]


def _argmax(logits: object, vocab: int) -> int:
    import numpy as np

    values = np.ctypeslib.as_array(logits, shape=(vocab,))  # type: ignore[arg-type]
    return int(values.argmax())


def one(args: argparse.Namespace) -> None:
    """Run one measurement in this process; print {"tok_s", "peak_rss_mb"} as JSON."""
    prompts = make_prompts(args.streams, args.prompt_len)
    if args.one == "llama.cpp":
        rate = run_llama_cpp(args.model, prompts, args.output_len, args.threads)
    else:
        rate = run_ours(args.model, prompts, args.output_len, args.threads, args.one == "detinf-inv")
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"tok_s": rate, "peak_rss_mb": peak_mb}))


def measure(args: argparse.Namespace, impl: str, streams: int) -> dict[str, float]:
    python = args.llama_python if impl == "llama.cpp" else sys.executable
    lengths = ("--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len))
    sizes = ("--streams", str(streams), *lengths)
    script = str(Path(__file__).resolve())
    command = [python, script, "--one", impl, "--model", args.model, *sizes, "--threads", str(args.threads)]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=root, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--llama-python", default=str(DEFAULT_PYTHON))
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--impls", nargs="+", default=["detinf-inv", "llama.cpp"])
    parser.add_argument("--one", choices=["detinf-inv", "detinf-plain", "llama.cpp"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        args.streams = args.streams[0]
        one(args)
        return
    size_mb = Path(args.model).stat().st_size / 2**20
    print(f"model {args.model} ({size_mb:.0f} MiB), threads {args.threads}, prompt {args.prompt_len}, "
          f"output {args.output_len}, repeats {args.repeats}")  # fmt: skip
    for streams in args.streams:
        runs: dict[str, list[dict[str, float]]] = {impl: [] for impl in args.impls}
        for _ in range(args.repeats):
            for impl in args.impls:
                runs[impl].append(measure(args, impl, streams))
        reference = statistics.median(r["tok_s"] for r in runs[args.impls[-1]])
        for impl, results in runs.items():
            rate = statistics.median(r["tok_s"] for r in results)
            peak = max(r["peak_rss_mb"] for r in results)
            listed = ", ".join(f"{r['tok_s']:.1f}" for r in results)
            ratio = f"({rate / reference:.2f}x {args.impls[-1]})"
            print(f"streams {streams:>2}  {impl:<12} {rate:8.1f} tok/s {ratio}  "
                  f"peak RSS {peak:6.0f} MiB ({peak / size_mb:.2f}x file)  runs {listed}")  # fmt: skip


if __name__ == "__main__":
    main()
