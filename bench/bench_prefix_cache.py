"""Time to first token with the first ~1,000 prompt tokens cached vs uncached (default model).

Run by hand:  .venv/bin/python bench/bench_prefix_cache.py [--prefix-len 1000] [--threads 1] [--repeats 3]
Each repeat measures a cold request (cache flushed) and a warm one (same prefix, different tail) side by
side; the ratio of medians is the figure to record in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.model.loader import load_model


def time_to_first_token(engine: Engine, prompt: list[int]) -> float:
    """Seconds from add_request to the step that returns the request's first token."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    start = time.perf_counter()
    request_id = engine.add_request(prompt, params)
    while True:
        outputs = engine.step()
        if any(o.request_id == request_id and o.outputs[0].token_ids for o in outputs):
            elapsed = time.perf_counter() - start
            break
    while engine.has_unfinished:
        engine.step()
    engine.release(request_id)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(None)
    engine = Engine(EngineConfig(selfcheck=False, threads=args.threads), loaded=loaded)
    rng = random.Random(0)
    prefix = [rng.randrange(100, loaded.spec.vocab_size) for _ in range(args.prefix_len)]
    cold, warm = [], []
    for repeat in range(args.repeats):
        engine.flush_prefix_cache()
        cold.append(time_to_first_token(engine, prefix + [200 + repeat, 7]))
        warm.append(time_to_first_token(engine, prefix + [300 + repeat, 9]))
    cold_median, warm_median = statistics.median(cold), statistics.median(warm)
    print(f"prefix {args.prefix_len} tokens, threads {args.threads}, repeats {args.repeats}")
    print(f"TTFT uncached median {cold_median * 1000:.0f} ms  {[round(c * 1000) for c in cold]}")
    print(f"TTFT cached   median {warm_median * 1000:.0f} ms  {[round(w * 1000) for w in warm]}")
    print(f"speed-up {cold_median / warm_median:.1f}x")


if __name__ == "__main__":
    main()
