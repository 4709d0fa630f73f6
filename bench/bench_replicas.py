"""Replicated serving on Ray vs plain serve, side by side in one run (default model).

Run by hand (not a test), from the repository root:
  .venv/bin/python -m bench.bench_replicas [--output-len 64] [--requests 64]

Starts, one after the other on free loopback ports, and measures each with bench_server's streaming
client (distinct prompts, ignore_eos, greedy):
  plain      `detinf serve --threads 1`                  (one process, no Ray)
  ray-1      `detinf serve --replicas 1 --threads 1`     (the Ray hop: proxy -> router -> replica)
  ray-2      `detinf serve --replicas 2 --threads 1`     (two replicas, one core each)
One engine thread each: on a shared, oversubscribed machine two OpenMP threads per engine spin at
every barrier (a 2-thread plain serve ran at 0.6 tok/s at concurrency 1 under load 15 here).
Per configuration: the per-request overhead (p50 latency of 1-token requests, concurrency 1), p50
latency of --output-len-token requests at concurrency 1, and aggregate tokens/s at concurrency 32.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from typing import Any

import httpx

from bench.bench_server import run_level, start_server

CONFIGS = {
    "plain": ["--threads", "1"],
    "ray-1": ["--replicas", "1", "--threads", "1"],
    "ray-2": ["--replicas", "2", "--threads", "1"],
}


def wait_all_replicas(base: str, timeout: float = 600) -> None:
    """For the replicated modes: every replica routable (not only the first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        document = httpx.get(base + "/healthz", timeout=10).json()
        replicas = document.get("replicas")
        if replicas is None or all(r["routable"] for r in replicas):
            return
        time.sleep(1)
    raise SystemExit(f"replicas not all routable: {document}")


def measure(name: str, extra: list[str], output_len: int, requests: int) -> dict[str, Any]:
    process, base = start_server(extra)
    try:
        wait_all_replicas(base)
        asyncio.run(run_level(base, 4, 8, 4, 8, seed=99))  # warm-up (both replicas)
        hop = asyncio.run(run_level(base, 1, 12, 1, 48, seed=1))
        single = asyncio.run(run_level(base, 1, 4, output_len, 48, seed=2))
        loaded = asyncio.run(run_level(base, 32, requests, output_len, 48, seed=3))
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=600)
    row = {"config": name, "serve_args": " ".join(extra),
           "one_token_p50_s": hop["latency_p50_s"], "c1_latency_p50_s": single["latency_p50_s"],
           "c1_tokens_per_s": single["tokens_per_s"], "c32_tokens_per_s": loaded["tokens_per_s"],
           "c32_latency_p50_s": loaded["latency_p50_s"]}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--requests", type=int, default=32, help="requests at concurrency 32")
    args = parser.parse_args()
    rows = [measure(name, extra, args.output_len, args.requests) for name, extra in CONFIGS.items()]
    print("\n| config | serve args | 1-token p50 | c=1 p50 (64 tok) | c=1 tok/s | c=32 tok/s | c=32 p50 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | `{r['serve_args']}` | {r['one_token_p50_s']} s | "
              f"{r['c1_latency_p50_s']} s | {r['c1_tokens_per_s']} | {r['c32_tokens_per_s']} | "
              f"{r['c32_latency_p50_s']} s |")


if __name__ == "__main__":
    main()
