"""SGLang's own determinism script (`sglang/test/test_deterministic.py` from the sglang wheel) against
`detinf serve`, all four modes: single, prefix, radix_cache, p_vs_d.

The wheel is never downloaded here (tests run offline) and no sglang code is committed: the test reads
the script and its prompt file out of a wheel already in the test cache, fetched beforehand with
`bash scripts/fetch_test_wheels.sh` (`pip download sglang==... --no-deps`), and writes a two-file shim
(`sglang/__init__.py`, `sglang/profiler.py`: the script imports `run_profile`, used only with
--profile) so the script runs without the rest of SGLang. Without the wheel the test skips, saying how to
fetch it. The server runs a tiny random llama with a 50048-token vocabulary (the script's radix_cache
mode sends random ids up to 50000) and an 8192-token context (its prompts reach 4097 characters).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.harness import RunningServer, subprocess_server
from tests.tiny_models import build_wide_vocab_model

SCRIPT = "sglang/test/test_deterministic.py"
PROMPT_FILE = "sglang/test/long_prompt.txt"
SHIM_PROFILER = '''"""Shim: the determinism script imports run_profile; profiling needs the real SGLang."""


def run_profile(*args, **kwargs):
    raise RuntimeError("profiling is not available in this shim")
'''
RUNNER = '''"""Run SGLang's determinism script in one mode; exit 1 unless every result is 1 (one unique
output, or a passed comparison)."""
import argparse
import random
import sys

from sglang.test.test_deterministic import BenchArgs, test_deterministic

# The prefix mode draws each request's prompt with the global, unseeded `random`: in a short run a prompt
# may never be drawn (no samples: result 0, ~5% of runs with 3 trials). Seed 2 draws each of the 4
# prompts 3 to 5 times in trials of 4, 5 and 6 requests, every run.
random.seed(2)
parser = argparse.ArgumentParser()
BenchArgs.add_cli_args(parser)
results = test_deterministic(parser.parse_args())  # as the script's __main__ does
print("RESULTS", results)
sys.exit(0 if results and all(value == 1 for value in results) else 1)
'''
# mode -> extra arguments (the script's defaults are 50 trials of 100 tokens: sized down for 2 cores)
MODES = {
    "single": ["--n-trials", "4", "--max-new-tokens", "24"],
    "prefix": ["--n-trials", "3", "--n-start", "4", "--max-new-tokens", "16", "--return-logprob"],
    "radix_cache": [],
    "p_vs_d": ["--n-trials", "2", "--max-new-tokens", "16"],
}


def wheel_dir() -> Path:
    """Where test-only wheels are cached ($DETINF_TEST_WHEELS, else <detinf cache>/test-wheels)."""
    if os.environ.get("DETINF_TEST_WHEELS"):
        return Path(os.environ["DETINF_TEST_WHEELS"])
    cache = os.environ.get("DETINF_CACHE_DIR") or str(Path("~/.cache/deterministic-inference").expanduser())
    return Path(cache) / "test-wheels"


def sglang_wheel() -> Path | None:
    """The newest cached sglang wheel, if any."""
    found = sorted(wheel_dir().glob("sglang-*.whl"))
    return found[-1] if found else None


@pytest.fixture(scope="module")
def script_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the script and its prompt file (from the wheel), the shim and the runner."""
    wheel = sglang_wheel()
    if wheel is None:
        pytest.skip(f"no sglang wheel in {wheel_dir()}; fetch it with `bash scripts/fetch_test_wheels.sh`")
    root = tmp_path_factory.mktemp("sglang-script")
    with zipfile.ZipFile(wheel) as archive:
        for name in (SCRIPT, PROMPT_FILE):
            target = root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive.read(name))
    (root / "sglang" / "__init__.py").write_text('"""Shim package for running SGLang\'s test script."""\n')
    (root / "sglang" / "profiler.py").write_text(SHIM_PROFILER)
    (root / "run_mode.py").write_text(RUNNER)
    return root


@pytest.fixture(scope="module")
def wide_server(tmp_path_factory: pytest.TempPathFactory, script_dir: Path) -> Iterator[RunningServer]:
    """`detinf serve` on the wide-vocabulary tiny model."""
    model = build_wide_vocab_model(tmp_path_factory.mktemp("wide") / "model")
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    with subprocess_server(["--model", str(model), "--num-kv-blocks", "2048"], log=log) as (server, _):
        yield server


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(MODES))
def test_sglang_determinism_script_passes(mode: str, script_dir: Path, wide_server: RunningServer) -> None:
    port = wide_server.base_url.rsplit(":", 1)[1]
    command = [sys.executable, str(script_dir / "run_mode.py"), "--host", "127.0.0.1", "--port", port,
               "--test-mode", mode, *MODES[mode]]
    env = {**os.environ, "PYTHONPATH": str(script_dir), "NO_PROXY": "*"}
    result = subprocess.run(command, cwd=script_dir, env=env, capture_output=True, text=True, timeout=900,
                            check=False)
    assert result.returncode == 0, f"{mode}:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    assert "RESULTS" in result.stdout
