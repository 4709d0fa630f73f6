"""Perplexity on a fixed English text: our dequantised path, our quantized path, and llama.cpp's own.

Run by hand from the repository root (llama.cpp runs in a child process under the bench venv's Python,
`--llama-python`, default `$BENCH_VENV/bin/python`; see bench/llama_cpp_worker.py):
    .venv/bin/python -m bench.bench_perplexity [--model FILE] [--threads 1] [--no-llama-cpp]

The text (bench/perplexity_text.txt, ~2.6k SmolLM2 tokens) is tokenized once by our tokenizer (no BOS:
the default model adds none) and the same ids are scored by every implementation in one pass each:
perplexity = exp(-mean log p(token i | tokens < i)) over tokens 1..n-1. Ours comes from prompt logprobs
(`prompt_logprobs=0`); llama.cpp's from its logits (`logits_all=True`, one `eval` of all ids),
log-softmaxed in float64.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np

from bench.llama_cpp_worker import DEFAULT_PYTHON

TEXT = Path(__file__).with_name("perplexity_text.txt")


def our_perplexity(
    model: str | None, ids: list[int], quantization: str, dtype: str, threads: int, numerics: str = "portable"
) -> float:
    """exp(-mean logprob) of ids[1:] from one prefill of our engine (prompt logprobs)."""
    from deterministic_inference.config import EngineConfig
    from deterministic_inference.engine.engine import Engine
    from deterministic_inference.engine.sampling_params import SamplingParams

    config = EngineConfig(
        model=model, quantization=quantization, dtype=dtype, threads=threads, selfcheck=False,
        max_model_len=max(len(ids) + 16, 4096), numerics_mode=numerics,
    )  # fmt: skip
    engine = Engine(config)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    logprobs = engine.generate([ids], params)[0].prompt_logprobs
    if logprobs is None or len(logprobs) != len(ids):
        raise SystemExit("the engine returned no prompt logprobs")
    scored = np.asarray(logprobs[1:], dtype=np.float64)
    return math.exp(-float(scored.mean()))


def llama_cpp_perplexity(model: str, ids: list[int], threads: int, python: str) -> tuple[float, bool]:
    """(perplexity of ids[1:] from llama.cpp's logits, whether llama.cpp tokenizes the text the same)."""
    from bench.llama_cpp_worker import LlamaCppWorker

    worker = LlamaCppWorker(python)
    try:
        worker.request(
            op="load", model=model, threads=threads, n_ctx=max(len(ids) + 16, 4096), logits_all=True
        )
        same_tokens = worker.request(op="tokenize", text=TEXT.read_text())["ids"] == ids
        return float(worker.request(op="perplexity", ids=ids)["perplexity"]), same_tokens
    finally:
        worker.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--llama-python", default=str(DEFAULT_PYTHON), help="a Python with llama_cpp")
    args = parser.parse_args()
    from deterministic_inference.model.default_model import default_model_path
    from deterministic_inference.model.loader import load_model
    from deterministic_inference.ops.native import native_kernels

    model = args.model or str(default_model_path())
    ids = list(load_model(model).tokenizer.encode(TEXT.read_text()))
    print(f"model {Path(model).name}; text {TEXT.name}: {len(ids)} tokens, {len(ids) - 1} scored")
    print("| implementation | perplexity | vs llama.cpp | seconds |\n|---|---|---|---|")
    rows: list[tuple[str, float, float]] = []
    runs = [
        ("detinf --quantization none (bf16 weights)", "none", "bfloat16", "portable"),
        ("detinf --quantization none --dtype float32", "none", "float32", "portable"),
        ("detinf --quantization auto (stored blocks, bf16 activations)", "auto", "bfloat16", "portable"),
        ("detinf --quantization auto --dtype float32", "auto", "float32", "portable"),
    ]
    if native_kernels().native_gemm_missing() is None:
        label = "detinf --numerics native (blocks dequantised to bf16, AMX-BF16 tiles)"
        runs.append((label, "auto", "bfloat16", "native"))
    for label, quantization, dtype, numerics in runs:
        start = time.perf_counter()
        rows.append(
            (
                label,
                our_perplexity(model, ids, quantization, dtype, args.threads, numerics),
                time.perf_counter() - start,
            )
        )
    reference = None
    if not args.no_llama_cpp:
        start = time.perf_counter()
        reference, same_tokens = llama_cpp_perplexity(model, ids, args.threads, args.llama_python)
        rows.append(("llama.cpp (llama-cpp-python, logits_all)", reference, time.perf_counter() - start))
        print(f"(llama.cpp tokenizes the text to the same ids: {same_tokens})")
    for label, ppl, seconds in rows:
        ratio = f"{ppl / reference:.4f}x" if reference else ""
        print(f"| {label} | {ppl:.4f} | {ratio} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
