"""Start-up of `detinf generate` on a GGUF file: whole-process wall time and its phases (issue 17).

Run by hand from the repository root (the 1B file from `python -m bench.make_gguf --qtype Q4_0`):
    .venv/bin/python -m bench.bench_startup --model /tmp/llama1b-Q4_0.gguf [--threads 1] [--repeats 3]

Each repeat is a fresh process: `python -c "import torch"` (the floor every Python process here pays),
`detinf generate --max-tokens 1` (import, load, engine build with the self-check, one token), and a
child that times the phases in-process: imports, `load_model` (header, tokenizer, memory map),
`Engine(...)` (model build, the file's sha256 beside it, the start-up self-check), the first token.
The target "load + self-check <= 5 s" reads the load and engine columns. Medians of the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PHASES = r"""
import json, sys, time
start = time.perf_counter()
from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.model.loader import load_model
imported = time.perf_counter()
loaded = load_model(sys.argv[1])
load = time.perf_counter()
engine = Engine(EngineConfig(model=sys.argv[1], threads=int(sys.argv[2])), loaded=loaded)
built = time.perf_counter()
engine.generate(["Hello"], SamplingParams(max_tokens=1, temperature=0.0))
first = time.perf_counter()
print(json.dumps({"imports": imported - start, "load_model": load - imported,
                  "engine (build + self-check)": built - load, "first token": first - built}))
"""


def wall(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    generate = [
        sys.executable, "-m", "deterministic_inference", "generate", "--model", args.model,
        "--prompt", "Hello", "--max-tokens", "1", "--threads", str(args.threads),
    ]  # fmt: skip
    rows: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        rows.setdefault("python -c 'import torch'", []).append(wall([sys.executable, "-c", "import torch"]))
        rows.setdefault("detinf generate --max-tokens 1 (whole process)", []).append(wall(generate))
        out = subprocess.run(
            [sys.executable, "-c", PHASES, args.model, str(args.threads)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        for phase, seconds in json.loads(out.strip().splitlines()[-1]).items():
            rows.setdefault(f"in-process: {phase}", []).append(seconds)
    size = os.path.getsize(args.model) / (1 << 20)
    print(
        f"model {args.model} ({size:.0f} MiB), threads {args.threads}, load average {os.getloadavg()[0]:.1f}"
    )
    print("| step | median s | runs |\n|---|---|---|")
    for name, values in rows.items():
        print(f"| {name} | {statistics.median(values):.2f} | {', '.join(f'{v:.2f}' for v in values)} |")


if __name__ == "__main__":
    main()
