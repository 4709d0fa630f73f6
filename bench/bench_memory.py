"""Peak resident memory of `detinf generate` and of an idle `detinf serve` (issue 17, item 5).

Run by hand from the repository root:
    .venv/bin/python -m bench.bench_memory [--model PATH] [--quantization auto] [--threads 1]

Each measurement is a fresh process; peak RSS comes from the kernel's accounting of that child
(`os.wait4` -> ru_maxrss), idle serve's from /proc/PID/status (VmHWM) once /healthz answers. The GGUF
file size and the KV cache the run used are printed beside it, with the target
peak <= file size + KV in use + 300 MB (and <= 500 MB for generate, <= 600 MB for idle serve on the
default model). Every figure is printed in MiB (2^20 bytes). The target is printed in both readings of
"300 MB": file + 300 MiB, and the stricter file + 300 * 10^6 bytes (~14 MiB lower).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

MIB = 1 << 20
DETINF = [sys.executable, "-m", "deterministic_inference"]
ALLOWANCE = {"MiB": 300 * MIB, "MB": 300 * 10**6}  # the two readings of the target's "300 MB"


def target_text(size: int, cap_mib: int | None, kv: str = "") -> str:
    """'<= X MiB (+300 MiB) / Y MiB (+300 MB)' over the file's `size` bytes, then `kv`, then the default
    model's own cap."""
    readings = [f"{(size + extra) / MIB:.0f} MiB (+300 {unit})" for unit, extra in ALLOWANCE.items()]
    return f"<= {' / '.join(readings)}{kv}" + (f"; <= {cap_mib} MiB" if cap_mib is not None else "")


def peak_rss_of(command: list[str]) -> tuple[int, float]:
    """(peak RSS bytes, wall seconds) of one child process run to completion."""
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        stderr = child.stderr.read().decode() if child.stderr else ""
        raise SystemExit(f"{' '.join(command)} failed: {stderr.strip()}")
    return usage.ru_maxrss * 1024, seconds


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def idle_serve_rss(engine_args: list[str]) -> tuple[int, int]:
    """(peak RSS, current RSS) bytes of `detinf serve` once it answers /healthz, before any request."""
    port = free_port()
    server = subprocess.Popen(
        [*DETINF, "serve", "--port", str(port), *engine_args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            raise SystemExit("detinf serve did not become healthy within 300 s")
        time.sleep(1.0)
        fields = dict(
            line.split(":", 1) for line in Path(f"/proc/{server.pid}/status").read_text().splitlines()
        )
        return int(fields["VmHWM"].split()[0]) * 1024, int(fields["VmRSS"].split()[0]) * 1024
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    from deterministic_inference.model.default_model import default_model_path

    model = Path(args.model) if args.model else default_model_path()
    engine_args = ["--quantization", args.quantization, "--threads", str(args.threads)]
    if args.model:
        engine_args += ["--model", args.model]
    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    generate = [*DETINF, "generate", "--prompt", prompt, "--max-tokens", str(args.max_tokens), *engine_args]
    size = model.stat().st_size
    print(f"model {model.name}: {size / MIB:.0f} MiB; engine args {' '.join(engine_args)}")
    print("| command | peak RSS | target | wall |\n|---|---|---|---|")
    torch_only, _ = peak_rss_of([sys.executable, "-c", "import torch"])
    print(f"| python -c 'import torch' | {torch_only / MIB:.0f} MiB | | |")
    for label, command in (
        ("detinf generate (self-check on)", generate),
        ("detinf generate --no-selfcheck", [*generate, "--no-selfcheck"]),
    ):
        peak, seconds = peak_rss_of(command)
        target = target_text(size, None if args.model else 500, " + KV in use")
        print(f"| {label} | {peak / MIB:.0f} MiB | {target} | {seconds:.1f} s |")
    peak, current = idle_serve_rss(engine_args)
    target = target_text(size, None if args.model else 600)
    print(f"| detinf serve, idle (peak / now) | {peak / MIB:.0f} / {current / MIB:.0f} MiB | {target} | |")


if __name__ == "__main__":
    main()
