"""llama.cpp (llama-cpp-python) as a child process of a benchmark: JSON requests in, JSON answers out.

The benchmarks run our engine in `.venv` and llama.cpp in the bench venv (`$BENCH_VENV`, default
`../bench-venv` beside the repository, from bench/requirements-bench.txt; never a product or test
dependency), alternating runs so both see the
same machine load. This file imports only llama_cpp, numpy and the standard library, so it runs under
the bench venv's Python without our package. `LlamaCppWorker` is the parent's handle.

Requests (one JSON object per line on stdin; one answer per line on stdout):
  {"op": "load", "model": PATH, "threads": N, "n_ctx": N, "logits_all": bool, "prompt_lookup": K}
                                                       (prompt_lookup: llama-cpp-python's prompt-lookup
                                                        decoding drafting K tokens; absent or 0 = off)
  {"op": "generate", "prompt": STR, "max_tokens": N}  -> generated tokens, seconds and seconds to the first
                                                          token (eos banned; no reuse of the last prompt)
  {"op": "perplexity", "ids": [...]}                   -> exp(-mean log p) of ids[1:], seconds
  {"op": "tokenize", "text": STR}                      -> ids (no BOS, no special-token parsing)
  {"op": "rss"}                                        -> this process's peak and current RSS (bytes)
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH_VENV_ENV = "BENCH_VENV"  # the bench venv's directory; default DEFAULT_VENV
DEFAULT_VENV = Path(__file__).resolve().parents[1].parent / "bench-venv"  # beside the repository
DEFAULT_PYTHON = Path(os.environ.get(BENCH_VENV_ENV) or DEFAULT_VENV) / "bin" / "python"


class LlamaCppWorker:
    """Parent side: starts the worker under `python` and sends it requests."""

    def __init__(self, python: Path | str = DEFAULT_PYTHON) -> None:
        self.process = subprocess.Popen(
            [str(python), str(Path(__file__).resolve())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def request(self, **message: Any) -> dict[str, Any]:
        """Send one request and wait for its answer; raises RuntimeError with the worker's error."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp worker exited (code {self.process.wait()})")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"llama.cpp worker: {answer['error']}")
        return answer

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=60)


def _rss() -> dict[str, int]:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {"peak": int(fields["VmHWM"].split()[0]) * 1024, "now": int(fields["VmRSS"].split()[0]) * 1024}


def _perplexity(llm: Any, ids: list[int]) -> float:
    import numpy as np

    llm.reset()
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)  # [n-1, vocab]
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(shifted).sum(axis=1))
    picked = shifted[np.arange(len(ids) - 1), ids[1:]] - log_norm  # [n-1]
    return math.exp(-float(picked.mean()))


def _generate(llm: Any, prompt: str, max_tokens: int, bias: dict[int, float] | None) -> dict[str, Any]:
    """One greedy request from an empty cache, streamed: tokens, total seconds, seconds to the first token.

    llama-cpp-python keeps the last request's tokens and evaluates only what follows their common prefix,
    so without `reset` a repeated prompt would skip its prefill (ours is timed from an empty cache too)."""
    llm.reset()
    start = time.perf_counter()
    first, tokens, text = 0.0, 0, ""
    for chunk in llm(prompt, max_tokens=max_tokens, temperature=0.0, logit_bias=bias, stream=True):
        tokens += 1
        text += chunk["choices"][0]["text"]
        if tokens == 1:
            first = time.perf_counter() - start
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "first_token_seconds": first, "text": text}


def _prompt_lookup(tokens: int) -> Any:
    """llama-cpp-python's prompt-lookup draft model proposing `tokens` tokens (None when 0)."""
    if not tokens:
        return None
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    return LlamaPromptLookupDecoding(num_pred_tokens=tokens)


def _handle(state: dict[str, Any], message: dict[str, Any]) -> dict[str, Any]:
    op = message["op"]
    if op == "load":
        import llama_cpp

        start = time.perf_counter()
        state["llm"] = llama_cpp.Llama(
            model_path=message["model"], n_threads=message["threads"], n_threads_batch=message["threads"],
            n_ctx=message.get("n_ctx", 1024), n_batch=512, logits_all=message.get("logits_all", False),
            draft_model=_prompt_lookup(message.get("prompt_lookup", 0)), verbose=False,
        )  # fmt: skip
        eos = state["llm"].token_eos()
        state["bias"] = {eos: -1e9} if eos >= 0 else None
        info = llama_cpp.llama_print_system_info().decode()
        return {"seconds": time.perf_counter() - start, "system_info": info, "version": llama_cpp.__version__}
    llm = state["llm"]
    if op == "generate":
        return _generate(llm, message["prompt"], message["max_tokens"], state["bias"])
    if op == "perplexity":
        start = time.perf_counter()
        return {"perplexity": _perplexity(llm, message["ids"]), "seconds": time.perf_counter() - start}
    if op == "tokenize":
        return {"ids": llm.tokenize(message["text"].encode(), add_bos=False, special=False)}
    if op == "rss":
        return _rss()
    raise ValueError(f"unknown op {op!r}")


def serve() -> None:
    """Answer requests from stdin until it closes."""
    state: dict[str, Any] = {}
    for line in sys.stdin:
        try:
            answer = _handle(state, json.loads(line))
        except Exception as exc:  # reported to the parent, which raises
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
