"""`--speculative-config` on `detinf generate` and `detinf serve`: same JSON (tokens, logprob bits,
fingerprint) as plain decoding, and one line naming the field for a bad setting."""

from __future__ import annotations

import json

import pytest

from tests.cli.test_generate_cli import detinf
from tests.tiny_models import TinyModel

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


def test_generate_with_speculation_prints_the_plain_json(tiny_llama_dir: TinyModel) -> None:
    args = (
        "generate", "--model", str(tiny_llama_dir.path),
        "--prompt", "the cat sat on the mat. the cat sat on the mat. the cat",
        "--prompt", "hello world",
        "--max-tokens", "20", "--temperature", "0.1", "--seed", "5", "--logprobs", "2",
        "--json", "--dtype", "float32", "--no-selfcheck",
    )  # fmt: skip
    plain, speculative = detinf(*args), detinf(*args, "--speculative-config", SPEC)
    assert plain.returncode == 0, plain.stderr
    assert speculative.returncode == 0, speculative.stderr
    assert json.loads(speculative.stdout) == json.loads(plain.stdout)  # fingerprint included


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize(
    ("value", "field"),
    [
        ('{"method": "eagle"}', "speculative_config.method"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "speculative_config.num_speculative_tokens"),
        ('{"method": "ngram"', "speculative_config"),
    ],
)
def test_bad_speculative_config_is_one_line(
    tiny_llama_dir: TinyModel, command: str, value: str, field: str
) -> None:
    extra = ("--prompt", "hi") if command == "generate" else ("--port", "0")
    result = detinf(command, "--model", str(tiny_llama_dir.path), *extra, "--speculative-config", value)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0], result.stderr
