"""`detinf generate` as users and other tools call it: JSON contract, batching, clear errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.tiny_models import TinyModel


def detinf(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deterministic_inference", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_json_contract(tiny_llama_dir: TinyModel) -> None:
    result = detinf(
        "generate",
        "--model",
        str(tiny_llama_dir.path),
        "--prompt",
        "hello world",
        "--prompt",
        "def f(x):",
        "--max-tokens",
        "5",
        "--logprobs",
        "2",
        "--json",
        "--dtype",
        "float32",
        "--no-selfcheck",
    )
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["system_fingerprint"].startswith("detinf-")
    assert len(document["outputs"]) == 2
    for entry in document["outputs"]:
        assert set(entry) == {
            "prompt_token_ids",
            "output_token_ids",
            "logprobs",
            "top_logprobs",
            "text",
            "finish_reason",
        }
        assert len(entry["output_token_ids"]) == len(entry["logprobs"]) == len(entry["top_logprobs"])
        assert all(len(step) == 2 for step in entry["top_logprobs"])


def test_generate_is_reproducible_across_processes(tiny_llama_dir: TinyModel) -> None:
    args = (
        "generate",
        "--model",
        str(tiny_llama_dir.path),
        "--prompt",
        "hello",
        "--max-tokens",
        "6",
        "--temperature",
        "0.9",
        "--seed",
        "3",
        "--json",
        "--dtype",
        "float32",
        "--no-selfcheck",
    )
    first, second = detinf(*args), detinf(*args, "--threads", "1")
    assert first.returncode == 0 and second.returncode == 0
    assert json.loads(first.stdout) == json.loads(second.stdout)


def test_bad_input_is_one_line_and_nonzero(tiny_llama_dir: TinyModel, tmp_path: object) -> None:
    for args, needle in [
        (("--max-tokens", "0"), "max_tokens"),
        (("--temperature", "-1"), "temperature"),
        (("--top-p", "2"), "top_p"),
        (("--model", "/nonexistent/model.gguf"), "/nonexistent/model.gguf"),
    ]:
        model_args = () if "--model" in args else ("--model", str(tiny_llama_dir.path))
        result = detinf("generate", "--prompt", "hi", "--no-selfcheck", *model_args, *args)
        assert result.returncode != 0
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], result.stderr


def test_kv_cache_memory_and_quantization_options(tiny_llama_dir: TinyModel) -> None:
    """Sizes with units are accepted; bad sizes, both pool sizes, and unknown formats are one line."""
    base = ("generate", "--model", str(tiny_llama_dir.path), "--prompt", "hi", "--max-tokens", "3",
            "--dtype", "float32", "--no-selfcheck", "--json")  # fmt: skip
    capped = detinf(*base, "--kv-cache-memory", "64MiB", "--quantization", "none")
    plain = detinf(*base)
    assert capped.returncode == 0 and plain.returncode == 0, capped.stderr
    assert json.loads(capped.stdout)["outputs"] == json.loads(plain.stdout)["outputs"]
    for args, needle in [
        (("--kv-cache-memory", "lots"), "kv_cache_memory: 'lots' is not a size"),
        (("--kv-cache-memory", "10"), "kv_cache_memory: 10 bytes hold no KV block"),
        (("--kv-cache-memory", "1GiB", "--num-kv-blocks", "8"), "set only one"),
    ]:
        result = detinf(*base, *args)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and needle in lines[0], result.stderr
    wrong = detinf(*base, "--quantization", "q4_0")
    assert wrong.returncode == 2 and "--quantization" in wrong.stderr


def test_generate_with_a_sentencepiece_gguf(tiny_spm_gguf: TinyModel) -> None:
    from deterministic_inference.model.loader import load_model

    prompt = "  Hello\tworld 你好 🦀 <start_of_turn>"
    args = ("generate", "--model", str(tiny_spm_gguf.path), "--prompt", prompt, "--max-tokens", "9", "--json")
    tokenizer = load_model(str(tiny_spm_gguf.path)).tokenizer
    for chat in (False, True):
        result = detinf(*args, "--dtype", "float32", "--no-selfcheck", *(["--chat"] if chat else []))
        assert result.returncode == 0, result.stderr
        (entry,) = json.loads(result.stdout)["outputs"]
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
        assert entry["prompt_token_ids"] == tokenizer.encode(rendered)
        ids = entry["prompt_token_ids"]
        assert ids[0] == 1 and 3 in ids  # BOS, and <start_of_turn> parsed as its control token
        assert entry["output_token_ids"]
        assert entry["text"] == tokenizer.decode(entry["output_token_ids"], continuation=True)


def test_generate_with_json_schema_and_regex(tiny_llama_dir: TinyModel, tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(schema))
    base = ("generate", "--model", str(tiny_llama_dir.path), "--prompt", "hi", "--prompt", "yo",
            "--max-tokens", "30", "--temperature", "1.0", "--seed", "4", "--dtype", "float32",
            "--no-selfcheck", "--json")  # fmt: skip
    constrained = detinf(*base, "--json-schema", str(schema_file))
    assert constrained.returncode == 0, constrained.stderr
    for entry in json.loads(constrained.stdout)["outputs"]:
        assert json.loads(entry["text"]) in ({"ok": True}, {"ok": False}) and entry["finish_reason"] == "stop"
    matched = detinf(*base, "--regex", "[0-9]{3}-[a-z]{2}")
    assert matched.returncode == 0, matched.stderr
    for entry in json.loads(matched.stdout)["outputs"]:
        assert re.fullmatch("[0-9]{3}-[a-z]{2}", entry["text"])


def test_bad_constraints_are_one_line_naming_the_flag(tiny_llama_dir: TinyModel, tmp_path: Path) -> None:
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "unsupported.json").write_text('{"type": "string", "format": "no-such-format"}')
    base = ("generate", "--model", str(tiny_llama_dir.path), "--prompt", "hi", "--dtype", "float32",
            "--no-selfcheck")  # fmt: skip
    for args, needle in [
        (("--json-schema", str(tmp_path / "missing.json")), "--json-schema: cannot read"),
        (("--json-schema", str(tmp_path / "broken.json")), "is not valid JSON"),
        (("--json-schema", str(tmp_path / "list.json")), "must hold a JSON object"),
        (("--json-schema", str(tmp_path / "unsupported.json")), "no-such-format"),
        (("--regex", "(a"), "--regex: structured output (regex)"),
    ]:
        result = detinf(*base, *args)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and needle in lines[0], result.stderr


def test_kv_cache_dtype_option(tiny_llama_dir: TinyModel, tiny_llama32_dir: TinyModel) -> None:
    """q8_0 runs and is fingerprinted (another system_fingerprint than auto); an unknown value, or q8_0 on
    a head_dim it cannot store, is one line naming --kv-cache-dtype, exit 2."""
    base = (
        "generate",
        "--prompt",
        "hi",
        "--max-tokens",
        "3",
        "--dtype",
        "float32",
        "--no-selfcheck",
        "--json",
    )
    runs = {
        kv: detinf(*base, "--model", str(tiny_llama32_dir.path), "--kv-cache-dtype", kv)
        for kv in ("auto", "q8_0")
    }
    for result in runs.values():
        assert result.returncode == 0, result.stderr
    documents = {kv: json.loads(result.stdout) for kv, result in runs.items()}
    assert documents["auto"]["system_fingerprint"] != documents["q8_0"]["system_fingerprint"]
    assert len(documents["q8_0"]["outputs"][0]["output_token_ids"]) == 3
    for model, value, needles in [
        (tiny_llama32_dir, "q4_0", ("--kv-cache-dtype", "'q4_0'", "auto, bf16, q8_0")),
        (tiny_llama_dir, "q8_0", ("--kv-cache-dtype q8_0", "head_dim 16", "auto or bf16")),
    ]:
        result = detinf(*base, "--model", str(model.path), "--kv-cache-dtype", value)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr
        assert all(needle in lines[0] for needle in needles), lines[0]
