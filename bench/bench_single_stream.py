"""Single-stream decode speed: our engine vs llama.cpp (llama-cpp-python) on the same GGUF and threads.

Run by hand (needs bench/requirements-bench.txt):
  .venv/bin/python bench/bench_single_stream.py [--threads 1] [--output-len 128] [--repeats 3]
Both generate greedily from the same prompt with eos ignored; tokens/s = generated tokens / wall time of
the whole request (prefill included). Runs alternate, so both see the same machine load.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.model.default_model import default_model_path
from deterministic_inference.model.loader import load_model

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def ours(engine: Engine, output_len: int) -> float:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    output = engine.generate([PROMPT], params)[0]
    return len(output.outputs[0].token_ids) / (time.perf_counter() - start)


def llama_cpp(llm: object, output_len: int) -> float:
    start = time.perf_counter()
    result = llm(PROMPT, max_tokens=output_len, temperature=0.0, logit_bias={2: -1e9})  # type: ignore[operator]
    return int(result["usage"]["completion_tokens"]) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    import llama_cpp as llama_cpp_module

    torch.set_num_threads(args.threads)
    llm = llama_cpp_module.Llama(
        model_path=str(default_model_path()), n_threads=args.threads, n_ctx=1024, verbose=False
    )
    loaded = load_model(None)
    engines = {
        "detinf-inv": Engine(EngineConfig(dtype=args.dtype, selfcheck=False), loaded=loaded),
        "detinf-plain": Engine(EngineConfig(dtype=args.dtype, batch_invariant=False), loaded=loaded),
    }
    rates: dict[str, list[float]] = {name: [] for name in (*engines, "llama.cpp")}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            rates[name].append(ours(engine, args.output_len))
        rates["llama.cpp"].append(llama_cpp(llm, args.output_len))
    reference = statistics.median(rates["llama.cpp"])
    print(f"threads {args.threads}, output {args.output_len} tokens, repeats {args.repeats}")
    for name, values in rates.items():
        median = statistics.median(values)
        runs = [round(v, 1) for v in values]
        print(f"{name:<14} {median:8.1f} tok/s  ({median / reference:.2f}x llama.cpp)  runs {runs}")


if __name__ == "__main__":
    main()
