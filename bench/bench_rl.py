"""RL policy forward + backward throughput: the invariant policy (engine kernels, autograd backward) next
to the same decoder on plain torch ops with ordinary autograd (`Policy(invariant=False)`).

Run by hand:  .venv/bin/python -m bench.bench_rl [--batch 8] [--length 256] [--threads 1] [--repeats 3]
Default model, `--quantization none`, the engine's dtype (bf16 on CPUs with native bf16), fp32 master
weights. Each repeat times one forward + backward of `batch` random sequences of `length` tokens (loss:
the sum of every token's logprob but the first) for both policies, alternating, after one warm-up each;
tokens/s = batch * length / median wall seconds; the process CPU time is reported too (on a shared machine
it is the steadier figure). Also reports peak RSS (whole process, both policies loaded).
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time

import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.model.loader import load_model
from deterministic_inference.rl import Policy


def step_seconds(policy: Policy, sequences: list[list[int]]) -> tuple[float, float]:
    """(wall, process CPU) seconds of one forward + backward over `sequences`; gradients cleared first."""
    policy.zero_grad(set_to_none=True)
    start, cpu = time.perf_counter(), time.process_time()
    loss = torch.cat(policy.score(sequences)).sum()
    loss.backward()
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = EngineConfig(quantization="none", threads=args.threads)
    loaded = load_model(config.model, config.quantization)
    policies = {"invariant": Policy(loaded, config), "plain torch": Policy(loaded, config, invariant=False)}
    rng = random.Random(0)
    vocab = loaded.spec.vocab_size
    sequences = [[rng.randrange(100, vocab) for _ in range(args.length)] for _ in range(args.batch)]
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in policies}
    for policy in policies.values():
        step_seconds(policy, sequences)  # warm-up (kernel build, allocator)
    for _ in range(args.repeats):
        for name, policy in policies.items():
            times[name].append(step_seconds(policy, sequences))
    tokens = args.batch * args.length
    dtype = policies["invariant"].numerics.dtype
    print(f"{args.batch} x {args.length} tokens, threads {args.threads}, dtype {dtype}")
    medians: dict[str, tuple[float, float]] = {}
    for name, runs in times.items():
        wall, cpu = (statistics.median(run[i] for run in runs) for i in (0, 1))
        medians[name] = wall, cpu
        shown = [round(run[0], 2) for run in runs]
        print(f"{name:12s} {tokens / wall:7.0f} tok/s (wall, median {wall:.2f} s {shown}); CPU {cpu:.2f} s")
    for index, kind in ((0, "wall"), (1, "CPU")):
        ratio = medians["plain torch"][index] / medians["invariant"][index]
        print(f"invariant / plain torch throughput ({kind} time): {ratio:.2f}x")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
