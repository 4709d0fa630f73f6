"""`--model DIR --model-file NAME` on generate / serve / selfcheck: a directory holding one GGUF per
quantization (a ``*-GGUF`` Hugging Face snapshot) runs the named file; bad choices are one line, exit 2."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from deterministic_inference.cli.main import main

F32, Q8 = "tiny-llama-f32.gguf", "tiny-llama-q8_0.gguf"  # the two files of the gguf_repo_dir fixture


def _generate(*model_args: str) -> subprocess.CompletedProcess[str]:
    args = ("generate", *model_args, "--prompt", "hello world", "--max-tokens", "6", "--logprobs", "2",
            "--temperature", "0.8", "--seed", "5", "--dtype", "float32", "--no-selfcheck", "--json")
    return subprocess.run([sys.executable, "-m", "deterministic_inference", *args], capture_output=True,
                          text=True, timeout=300, check=False)


def _in_process(*args: str) -> tuple[int, str]:
    """`detinf ARGS` in this process: (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, err.getvalue()


def test_generate_runs_the_named_file_of_a_directory(gguf_repo_dir: Path) -> None:
    picked = _generate("--model", str(gguf_repo_dir), "--model-file", Q8)
    direct = _generate("--model", str(gguf_repo_dir / Q8))
    other = _generate("--model", str(gguf_repo_dir), "--model-file", F32)
    assert picked.returncode == 0 and direct.returncode == 0 and other.returncode == 0, picked.stderr
    picked_doc, other_doc = json.loads(picked.stdout), json.loads(other.stdout)
    assert picked_doc == json.loads(direct.stdout)  # the same tokens, logprobs and fingerprint as the file
    assert picked_doc["outputs"][0]["logprobs"] != other_doc["outputs"][0]["logprobs"]  # the choice matters


@pytest.mark.parametrize(
    ("command", "args", "needles"),
    [
        ("generate", ("--model", "{dir}"), ("--model-file NAME", f"{F32}, {Q8}")),
        ("generate", ("--model", "{dir}", "--model-file", "q4.gguf"),
         ("--model-file q4.gguf", "no such GGUF")),
        ("generate", ("--model-file", Q8), ("--model-file", "needs --model DIR")),
        ("generate", ("--model", "{dir}/" + F32, "--model-file", Q8), ("--model-file", "not a directory")),
        ("serve", ("--model", "{dir}", "--model-file", "absent.gguf", "--port", "1"),
         ("--model-file absent",)),
        ("selfcheck", ("--model", "{dir}"), ("--model-file NAME",)),
    ],
)
def test_bad_model_choice_is_one_line(gguf_repo_dir: Path, command: str, args: tuple[str, ...],
                                      needles: tuple[str, ...]) -> None:
    extra = ("--prompt", "hi", "--no-selfcheck") if command == "generate" else ()
    code, err = _in_process(command, *(arg.format(dir=gguf_repo_dir) for arg in args), *extra)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert all(needle in lines[0] for needle in needles), err


def test_selfcheck_takes_model_file(gguf_repo_dir: Path) -> None:
    code, err = _in_process("selfcheck", "--model", str(gguf_repo_dir), "--model-file", F32, "--dtype",
                            "float32", "--json")
    assert code == 0, err
