"""examples/grpo_toy.py runs end to end (tiny random Llama, 2 steps): every sampled token's importance
ratio is exactly 1.0 (the script raises otherwise) and each weight push changes the fingerprint."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.tiny_models import TinyModel

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "grpo_toy.py"


def test_grpo_example_runs_on_policy(tiny_llama_dir: TinyModel) -> None:
    command = [
        sys.executable,
        str(SCRIPT),
        "--model",
        str(tiny_llama_dir.path),
        "--steps",
        "2",
        "--group",
        "3",
    ]
    command += ["--max-tokens", "6", "--lr", "1e-2", "--threads", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    steps = re.findall(
        r"step \d+: .* tokens all with ratio exactly 1\.0, .* -> (detinf-[0-9a-f]{16})", result.stdout
    )
    first = re.search(r"engine (detinf-[0-9a-f]{16})", result.stdout)
    assert len(steps) == 2 and first is not None
    assert len({first.group(1), *steps}) == 3
