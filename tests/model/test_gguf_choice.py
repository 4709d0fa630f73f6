"""Directories of GGUF files (``*-GGUF`` Hugging Face snapshots): which file `choose_gguf` picks, the
one-line refusals, and `load_model` on such a directory."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from deterministic_inference.errors import ModelLoadError
from deterministic_inference.model.gguf_choice import choose_gguf
from deterministic_inference.model.loader import load_model
from tests.tiny_models import TinyModel


def _one_line(error: pytest.ExceptionInfo[ModelLoadError]) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_pick_by_name_and_by_quant_case_insensitive(gguf_repo_dir: Path) -> None:
    assert choose_gguf(gguf_repo_dir, name="tiny-llama-f32.gguf") == gguf_repo_dir / "tiny-llama-f32.gguf"
    assert choose_gguf(gguf_repo_dir, quant="Q8_0") == gguf_repo_dir / "tiny-llama-q8_0.gguf"
    assert choose_gguf(gguf_repo_dir, quant="f32") == gguf_repo_dir / "tiny-llama-f32.gguf"


def test_single_gguf_without_config_needs_no_choice(gguf_repo_dir: Path, tmp_path: Path) -> None:
    shutil.copy(gguf_repo_dir / "tiny-llama-q8_0.gguf", tmp_path / "only-q8_0.gguf")
    (tmp_path / "README.md").write_text("readme")
    assert choose_gguf(tmp_path) == tmp_path / "only-q8_0.gguf"


def test_hf_directory_is_left_to_the_hf_loader(tiny_llama_dir: TinyModel) -> None:
    assert choose_gguf(tiny_llama_dir.path) is None


def test_several_ggufs_without_a_choice_list_them(gguf_repo_dir: Path) -> None:
    with pytest.raises(ModelLoadError) as error:
        choose_gguf(gguf_repo_dir)
    message = _one_line(error)
    assert "--model-file NAME" in message
    assert "tiny-llama-f32.gguf, tiny-llama-q8_0.gguf" in message


@pytest.mark.parametrize(
    ("name", "quant", "needles"),
    [
        ("absent.gguf", None, ("--model-file absent.gguf", "no such GGUF", "tiny-llama-q8_0.gguf")),
        ("README.md", None, ("--model-file README.md", "no such GGUF")),
        ("../x.gguf", None, ("--model-file ../x.gguf", "not a path")),
        (None, "Q4_K_M", ("'Q4_K_M'", "no GGUF file", "tiny-llama-f32.gguf")),
        (None, "tiny-llama", ("2 GGUF files match", "--model-file NAME")),
    ],
)
def test_bad_name_or_quant_is_one_line(gguf_repo_dir: Path, name: str | None, quant: str | None,
                                       needles: tuple[str, ...]) -> None:
    with pytest.raises(ModelLoadError) as error:
        choose_gguf(gguf_repo_dir, name=name, quant=quant)
    message = _one_line(error)
    assert all(needle in message for needle in needles), message


def test_split_gguf_is_refused(gguf_repo_dir: Path, tmp_path: Path) -> None:
    for part in ("model-q8_0-00001-of-00002.gguf", "model-q8_0-00002-of-00002.gguf"):
        shutil.copy(gguf_repo_dir / "tiny-llama-q8_0.gguf", tmp_path / part)
    for name, quant in ((None, None), (None, "q8_0"), ("model-q8_0-00001-of-00002.gguf", None)):
        with pytest.raises(ModelLoadError) as error:
            choose_gguf(tmp_path, name=name, quant=quant)
        assert "split GGUF" in _one_line(error) and "llama-gguf-split --merge" in str(error.value)


def test_load_model_on_a_single_gguf_directory(gguf_repo_dir: Path, tmp_path: Path) -> None:
    shutil.copy(gguf_repo_dir / "tiny-llama-f32.gguf", tmp_path / "tiny-llama-f32.gguf")
    from_dir = load_model(str(tmp_path))
    from_file = load_model(str(gguf_repo_dir / "tiny-llama-f32.gguf"))
    assert from_dir.source == "gguf" and from_dir.artifacts == (tmp_path / "tiny-llama-f32.gguf",)
    assert set(from_dir.weights) == set(from_file.weights)


def test_load_model_on_several_ggufs_names_the_option(gguf_repo_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="--model-file NAME"):
        load_model(str(gguf_repo_dir))
