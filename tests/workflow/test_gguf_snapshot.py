"""`init --model-id` / `--model` on a ``*-GGUF`` snapshot (one GGUF per quantization, no config.json):
the file is picked by `--model-file NAME` or `ID:QUANT`, recorded as model.source.file, and that exact
file is what the manifest, the lock and the run hash and load. The HF cache is built locally."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from deterministic_inference.workflow.artifacts import hash_file
from tests.workflow.helpers import detinf, edit_manifest, read_json
from tests.workflow.hf_cache_builder import add_snapshot

GGUF_REPO = "org/tiny-llama-GGUF"
F32, Q8 = "tiny-llama-f32.gguf", "tiny-llama-q8_0.gguf"


@pytest.fixture()
def gguf_cache(gguf_repo_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private HF cache holding `gguf_repo_dir` as GGUF_REPO; returns the snapshot directory."""
    cache = tmp_path / "hf-cache"
    commit = add_snapshot(cache, GGUF_REPO, gguf_repo_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache / ("models--" + GGUF_REPO.replace("/", "--")) / "snapshots" / commit


@pytest.mark.parametrize(("args", "chosen"), [
    (("--model-id", f"{GGUF_REPO}:Q8_0"), Q8),
    (("--model-id", f"{GGUF_REPO}:f32"), F32),
    (("--model-id", GGUF_REPO, "--model-file", Q8), Q8),
])
def test_init_records_the_chosen_file(gguf_cache: Path, tmp_path: Path, args: tuple[str, ...],
                                      chosen: str) -> None:
    path = tmp_path / "m.json"
    result = detinf("init", "--output", path, *args, "--n-prompts", "1")
    assert result.code == 0, result.err
    model = read_json(path)["model"]
    assert model["source"] == {"type": "huggingface", "repo": GGUF_REPO, "revision": "main", "file": chosen}
    assert model["files"] == [{"path": chosen, "digest": hash_file(gguf_cache / chosen), "role": "weights"}]


def test_init_on_a_single_gguf_directory_needs_no_choice(gguf_repo_dir: Path, tmp_path: Path) -> None:
    directory = tmp_path / "one-gguf"
    directory.mkdir()
    shutil.copy(gguf_repo_dir / Q8, directory / Q8)
    (directory / "README.md").write_text("readme")
    path = tmp_path / "m.json"
    assert detinf("init", "--output", path, "--model", directory).code == 0
    model = read_json(path)["model"]
    assert model["source"] == {"type": "path", "path": str(directory.resolve()), "file": Q8}
    assert [entry["path"] for entry in model["files"]] == [Q8]


@pytest.mark.parametrize(("args", "needles"), [
    (("--model-id", GGUF_REPO), ("--model-file NAME", f"{F32}, {Q8}")),
    (("--model-id", f"{GGUF_REPO}:Q4_K_M"), (":Q4_K_M", "no GGUF file", F32)),
    (("--model-id", f"{GGUF_REPO}:tiny"), (":tiny", "2 GGUF files match")),
    (("--model-id", f"{GGUF_REPO}:"), ("--model-id", "empty quant tag")),
    (("--model-id", f"{GGUF_REPO}:Q8_0", "--model-file", Q8), ("--model-file", "not both")),
    (("--model-id", GGUF_REPO, "--model-file", "q2_k.gguf"), ("--model-file q2_k.gguf", "no such GGUF")),
    (("--model-file", Q8), ("--model-file", "needs --model DIR or --model-id")),
])
def test_init_bad_choice_is_one_line(gguf_cache: Path, tmp_path: Path, args: tuple[str, ...],
                                     needles: tuple[str, ...]) -> None:
    result = detinf("init", "--output", tmp_path / "m.json", *args)
    assert result.code == 2 and "\n" not in result.err.strip(), result.err
    assert all(needle in result.err for needle in needles), result.err
    assert not (tmp_path / "m.json").exists()


def test_init_lock_run_on_a_gguf_snapshot_pins_and_loads_the_chosen_file(
    gguf_cache: Path, gguf_repo_dir: Path, tmp_path: Path
) -> None:
    runs = {}
    sources: dict[str, tuple[str | Path, ...]] = {
        "snapshot": ("--model-id", f"{GGUF_REPO}:q8_0"), "file": ("--model", gguf_repo_dir / Q8),
    }
    for name, args in sources.items():
        path = tmp_path / f"{name}.json"
        assert detinf("init", "--output", path, *args, "--n-prompts", "2", "--max-tokens", "5").code == 0
        edit_manifest(path, {"engine": {"num_kv_blocks": 256}})
        locked = detinf("lock", "--config", path)
        assert locked.code == 0, locked.err
        lock = read_json(tmp_path / f"{name}.lock.json")
        assert [(entry["path"], entry["digest"]) for entry in lock["model"]["files"]] == [
            (Q8, hash_file(gguf_repo_dir / Q8))
        ]
        ran = detinf("run", "--config", path, "--output-dir", tmp_path / f"run-{name}")
        assert ran.code == 0, ran.err
        run_dir = tmp_path / f"run-{name}"
        runs[name] = (read_json(run_dir / "tokens.json")["sequences"],
                      read_json(run_dir / "captures" / "logits.json")["sequences"])
    assert hash_file(gguf_repo_dir / Q8) != hash_file(gguf_repo_dir / F32)
    assert runs["snapshot"] == runs["file"]  # same tokens and logits: the snapshot run loaded the Q8_0 file


def test_manifest_without_a_choice_or_with_a_path_is_refused(gguf_cache: Path, tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    assert detinf("init", "--output", path, "--model-id", f"{GGUF_REPO}:Q8_0", "--n-prompts", "1").code == 0
    document = read_json(path)
    del document["model"]["source"]["file"]
    unpicked = tmp_path / "unpicked.json"
    unpicked.write_text(json.dumps(document))
    result = detinf("lock", "--config", unpicked)
    assert result.code == 2 and "$.model.source.file NAME" in result.err and Q8 in result.err, result.err
    edit_manifest(path, {"model": {"source": {"file": "sub/x.gguf"}}})
    result = detinf("lock", "--config", path)
    assert result.code == 2 and "$.model.source" in result.err, result.err


def test_gpu_backend_refuses_a_gguf_file_of_a_snapshot(gguf_cache: Path, tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    assert detinf("init", "--output", path, "--model-id", f"{GGUF_REPO}:Q8_0", "--n-prompts", "1").code == 0
    edit_manifest(path, {"runtime": {"execution": {"backend": "vllm", "base_url": "http://127.0.0.1:8123"}}})
    result = detinf("lock", "--config", path)
    assert result.code == 2 and "\n" not in result.err.strip(), result.err
    assert "$.model.source.file" in result.err and "'vllm'" in result.err, result.err


def test_serve_config_refuses_model_file(gguf_cache: Path, tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    assert detinf("init", "--output", path, "--model-id", f"{GGUF_REPO}:Q8_0", "--n-prompts", "1").code == 0
    result = detinf("serve", "--config", path, "--model-file", Q8)
    assert result.code == 2 and "--model-file: give either --config or --model-file" in result.err, result.err
