"""Server throughput and latency over HTTP: aggregate generated tokens/s and p50/p99 request latency
(plus time to first token) at several concurrency levels, streaming /v1/completions.

Run by hand (not a test):
  .venv/bin/python bench/bench_server.py [--concurrency 1 8 32] [--requests-per-level N] [--output-len 64]
      [--prompt-words 48] [--base-url URL | --serve-args "--threads 1 ..."]
Without --base-url it starts `detinf serve` (default model) on a free loopback port and stops it after.
Every request has a distinct prompt (no prefix-cache shortcuts) and ignore_eos, so each generates
exactly --output-len tokens. Prints one JSON line per level and a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

WORDS = "river mountain engine paper window garden silver station bridge winter lantern music harbor".split()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
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
    process = subprocess.Popen([*command, *extra])
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited with {process.returncode}")
        try:
            if httpx.get(base + "/healthz", timeout=2).status_code == 200:
                return process, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise SystemExit("server did not become healthy")


async def one_request(client: httpx.AsyncClient, base: str, prompt: str, output_len: int) -> dict[str, float]:
    body = {
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
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(
        timeout=3600, limits=httpx.Limits(max_connections=concurrency + 2)
    ) as client:

        async def limited(prompt: str) -> dict[str, float]:
            async with semaphore:
                return await one_request(client, base, prompt, output_len)

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
    args = parser.parse_args()
    process = None
    base = args.base_url
    if base is None:
        process, base = start_server(shlex.split(args.serve_args))
    try:
        asyncio.run(run_level(base, 1, 1, 4, 8, seed=99))  # warm-up
        rows = []
        for level, concurrency in enumerate(args.concurrency):
            requests = args.requests_per_level or max(4, 2 * concurrency)
            row = asyncio.run(
                run_level(base, concurrency, requests, args.output_len, args.prompt_words, seed=level)
            )
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=600)
    print("\n| concurrency | requests | tokens/s | latency p50 | latency p99 | TTFT p50 | TTFT p99 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['concurrency']} | {r['requests']} | {r['tokens_per_s']} | {r['latency_p50_s']} s | "
            f"{r['latency_p99_s']} s | {r['ttft_p50_s']} s | {r['ttft_p99_s']} s |"
        )


if __name__ == "__main__":
    main()
