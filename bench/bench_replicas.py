"""Replicated serving on Ray vs plain serve, side by side in one run (default model).

Run by hand (not a test), from the repository root:
  .venv/bin/python -m bench.bench_replicas [--output-len 64] [--requests 64]

Starts all three on free loopback ports, then measures them in alternating rounds (medians reported,
so load from other processes hits each configuration alike) with bench_server's streaming client
(distinct prompts, ignore_eos, greedy):
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
import statistics
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


def measure_once(name: str, base: str, output_len: int, requests: int, seed: int) -> dict[str, Any]:
    """One round on a running server."""
    hop = asyncio.run(run_level(base, 1, 12, 1, 48, seed=seed))
    single = asyncio.run(run_level(base, 1, 4, output_len, 48, seed=seed + 1))
    loaded = asyncio.run(run_level(base, 32, requests, output_len, 48, seed=seed + 2))
    return {"config": name, "one_token_p50_s": hop["latency_p50_s"],
            "c1_latency_p50_s": single["latency_p50_s"], "c1_tokens_per_s": single["tokens_per_s"],
            "c32_tokens_per_s": loaded["tokens_per_s"], "c32_latency_p50_s": loaded["latency_p50_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--requests", type=int, default=32, help="requests at concurrency 32")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the table shows medians")
    args = parser.parse_args()
    servers = {}
    try:
        for name, extra in CONFIGS.items():  # all up at once; measured in alternating rounds
            servers[name] = start_server(extra)
            wait_all_replicas(servers[name][1])
            asyncio.run(run_level(servers[name][1], 4, 8, 4, 8, seed=99))  # warm-up (every replica)
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
        for round_index in range(args.rounds):
            for name, (_, base) in servers.items():
                row = measure_once(name, base, args.output_len, args.requests, seed=10 * round_index)
                print(json.dumps({"round": round_index, **row}), flush=True)
                rounds[name].append(row)
    finally:
        for process, _ in servers.values():
            process.send_signal(signal.SIGTERM)
        for process, _ in servers.values():
            process.wait(timeout=600)
    rows = [{"config": name, "serve_args": " ".join(CONFIGS[name]),
             **{key: statistics.median(r[key] for r in runs) for key in runs[0] if key != "config"}}
            for name, runs in rounds.items()]
    print("\n| config | serve args | 1-token p50 | c=1 p50 (64 tok) | c=1 tok/s | c=32 tok/s | c=32 p50 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | `{r['serve_args']}` | {r['one_token_p50_s']} s | "
              f"{r['c1_latency_p50_s']} s | {r['c1_tokens_per_s']} | {r['c32_tokens_per_s']} | "
              f"{r['c32_latency_p50_s']} s |")


if __name__ == "__main__":
    main()
