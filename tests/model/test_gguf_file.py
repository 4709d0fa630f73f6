"""The GGUF header reader: string arrays read lazily (`StringArray`) equal the `gguf` package's values,
behave as sequences, refuse truncated bytes, and still read the same after the header's pages are given
back (`GGUFFile.release_header`)."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from deterministic_inference.model.gguf_file import GGUFFormatError, StringArray, read_gguf
from tests.tiny_models import TinyModel

TOKENS, MERGES = "tokenizer.ggml.tokens", "tokenizer.ggml.merges"


def test_string_arrays_equal_the_gguf_packages(tiny_llama_gguf: TinyModel) -> None:
    meta = read_gguf(tiny_llama_gguf.path).metadata
    reference = gguf.GGUFReader(tiny_llama_gguf.path).fields
    for key in (TOKENS, MERGES):
        ours = meta[key]
        assert isinstance(ours, StringArray) and len(ours) > 10
        assert list(ours) == reference[key].contents()


def test_string_array_is_a_sequence(tiny_llama_gguf: TinyModel) -> None:
    tokens = read_gguf(tiny_llama_gguf.path).metadata[TOKENS]
    as_list = list(tokens)
    assert len(tokens) == len(as_list)
    assert tokens[0] == as_list[0] and tokens[-1] == as_list[-1] and tokens[5] == as_list[5]
    assert tokens[3:9] == as_list[3:9] and tokens[::-50] == as_list[::-50]
    assert tokens == as_list and tokens == tuple(as_list) and tokens != as_list[:-1]
    assert tokens != [*as_list[:-1], as_list[-1] + "x"]
    assert as_list[7] in tokens and tokens.index(as_list[7]) == as_list.index(as_list[7])
    assert repr(tokens) == f"StringArray({len(as_list)} strings)"
    with pytest.raises(IndexError):
        tokens[len(as_list)]
    with pytest.raises(TypeError):
        hash(tokens)


def test_a_string_array_cut_short_is_refused(tiny_llama_gguf: TinyModel, tmp_path: Path) -> None:
    data = tiny_llama_gguf.path.read_bytes()
    key = TOKENS.encode()
    start = data.index(key) + len(key)  # the tokens' value type, item type and count follow the key
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: start + 200])
    with pytest.raises(GGUFFormatError, match="string array runs past the end"):
        read_gguf(cut)


def test_metadata_reads_the_same_after_the_header_is_given_back(tiny_llama_gguf: TinyModel) -> None:
    file = read_gguf(tiny_llama_gguf.path)
    before = {key: list(value) for key, value in file.metadata.items() if isinstance(value, StringArray)}
    assert 0 < file.header_bytes < tiny_llama_gguf.path.stat().st_size
    first_tensor = file.tensors[0].data.copy()
    file.release_header()
    after = {key: list(value) for key, value in file.metadata.items() if isinstance(value, StringArray)}
    assert after == before and (file.tensors[0].data == first_tensor).all()
