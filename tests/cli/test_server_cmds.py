"""`detinf serve` start-up: a model or engine that cannot start is reported in ONE line before the port is
bound (no uvicorn start-up lines first), with exit code 1; a good model gets uvicorn's lines and then the
ready line, once the port is bound."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.server.harness import detinf_command, free_port, subprocess_server, tiny_serve_args
from tests.tiny_models import TinyModel

REPO = Path(__file__).resolve().parents[2]


def serve_output(args: list[str], env: dict[str, str] | None = None) -> tuple[int, list[str]]:
    """Run `detinf serve ARGS` to its end (bounded); its exit code and its output lines (stdout and
    stderr together, in order)."""
    command = [*detinf_command(), "serve", "--host", "127.0.0.1", "--port", str(free_port()), *args]
    finished = subprocess.run(
        command,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=180,
    )
    return finished.returncode, finished.stdout.splitlines()


def test_an_unsupported_model_file_is_one_line_before_the_port_is_bound(tmp_path: Path) -> None:
    not_a_model = tmp_path / "notes.txt"
    not_a_model.write_text("hello\n")
    code, lines = serve_output(["--model", str(not_a_model), "--log-level", "info"])
    assert code == 1
    assert len(lines) == 1, lines  # no "Started server process" / "Uvicorn running on" before it
    assert lines[0].startswith("detinf serve: error: the engine failed to start: ModelLoadError: ")
    assert str(not_a_model) in lines[0] and "not a GGUF file" in lines[0]


def test_an_engine_that_cannot_build_its_kernels_is_one_line(tiny_llama_dir: TinyModel) -> None:
    """The model loads; the engine cannot start (its kernels cannot be built for that -march)."""
    code, lines = serve_output(tiny_serve_args(tiny_llama_dir), env={"DETINF_KERNEL_MARCH": "pentium"})
    assert code == 1
    assert len(lines) == 1, lines
    assert lines[0].startswith("detinf serve: error: the engine failed to start: NativeBuildError: ")
    assert "DETINF_KERNEL_MARCH" in lines[0]


def test_control_a_good_model_prints_the_server_lines_then_ready(
    tiny_llama_dir: TinyModel, tmp_path: Path
) -> None:
    """The check above can fail: a server that starts does print uvicorn's start-up lines, and the ready
    line comes after the port is bound."""
    log = tmp_path / "serve.log"
    with subprocess_server(tiny_serve_args(tiny_llama_dir), log=log):
        pass
    lines = log.read_text().splitlines()
    running = next(i for i, line in enumerate(lines) if "Uvicorn running on" in line)
    ready = next(i for i, line in enumerate(lines) if line.startswith("detinf serve: ready: model tiny,"))
    assert running < ready
    assert not any("error" in line for line in lines[:ready])
