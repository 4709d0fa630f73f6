"""SentencePiece vocabularies from GGUF ("llama") and HF directories against their references:
sentencepiece itself, transformers' Llama/Gemma tokenizers, and llama.cpp's rules (prefix space per
fragment, byte fallback, specials parsed in text, add_bos/add_eos)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from deterministic_inference.errors import ModelLoadError
from deterministic_inference.model.loader import load_model
from deterministic_inference.model.spm_tokenizer import spm_backend
from deterministic_inference.model.tokenizer import Tokenizer
from tests.spm_models import corpus, gguf_vocab, train_spm, write_spm_gguf, write_spm_hf_dir

TEXTS = [
    "Hello world",
    " leading space",
    "   three leading spaces and trailing  ",
    "repeated    spaces\tand\ttabs",
    "new\nlines\n\n and\r\nCRLF\n",
    "digits 0123456789 and 3.14159",
    "你好世界 中文字符 日本語",
    "emoji 😀🙂👍🏽 and rare ones 🦀🧬",
    "byte fallback: ǅ 𝔘 ∮ \x01 \u200b",
    "Grüße, ça va? naïve Ελληνικά ключ",
    "",
    " ",
    "x",
]
SPECIAL_TEXTS = [
    "<start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n",
    "<s>text after bos</s> and after eos",
    "<end_of_turn>   spaces after a special",
]


@pytest.fixture(scope="module", params=[True, False], ids=["prefix", "no-prefix"])
def spm_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trained SentencePiece BPE model, with and without the dummy prefix (Llama vs Gemma style)."""
    return train_spm(tmp_path_factory.mktemp("spm"), add_dummy_prefix=bool(request.param))


def _processor(model_path: Path) -> Any:
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(model_path))


def _prefix(model_path: Path) -> bool:
    from deterministic_inference.model.spm_model_file import read_sentencepiece_model

    return read_sentencepiece_model(model_path).add_dummy_prefix


def _gguf_tokenizer(model_path: Path, tmp_path: Path, **flags: Any) -> Tokenizer:
    flags.setdefault("add_space_prefix", _prefix(model_path))
    tmp_path.mkdir(parents=True, exist_ok=True)
    return load_model(str(write_spm_gguf(tmp_path / "tiny-spm.gguf", model_path, **flags).path)).tokenizer


@pytest.fixture(scope="module")
def gguf_tok(spm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return _gguf_tokenizer(spm_model, tmp_path_factory.mktemp("gguf"))


def _all_texts() -> list[str]:
    return TEXTS + corpus(seed=11, lines=200)


def _piece_soup(pieces: list[str], count: int = 600) -> list[str]:
    """Random runs of pieces (spaces for U+2581) and loose characters: every merge order gets exercised."""
    rng = random.Random(3)
    normal = [p.replace("\u2581", " ") for p in pieces if not p.startswith("<")]
    chars = sorted({c for p in normal for c in p}) + list(" \t\n你好😀ǅ🦀")
    def pick() -> str:
        return rng.choice(normal) if rng.random() < 0.5 else rng.choice(chars)

    return ["".join(pick() for _ in range(rng.randint(1, 30))) for _ in range(count)]


def test_ids_equal_sentencepiece(spm_model: Path, gguf_tok: Tokenizer) -> None:
    proc = _processor(spm_model)
    for text in _all_texts() + _piece_soup(gguf_vocab(spm_model)[0]):
        assert gguf_tok.encode(text, add_special_tokens=False) == proc.encode(text), repr(text)
    # the test can fail: the same vocabulary with the prefix rule flipped tokenizes differently
    pieces, scores, types = gguf_vocab(spm_model)
    flipped = spm_backend(pieces, scores, types, add_space_prefix=not _prefix(spm_model), unk_id=0)
    assert any(flipped.encode(t, add_special_tokens=False).ids != proc.encode(t) for t in TEXTS)


def test_specials_in_text_follow_llama_cpp(spm_model: Path, gguf_tok: Tokenizer) -> None:
    """llama.cpp: control tokens are cut out first; each text fragment is tokenized alone (with its own
    prefix space when add_space_prefix), so the reference is sentencepiece per fragment."""
    proc = _processor(spm_model)
    turn, end = proc.piece_to_id("<start_of_turn>"), proc.piece_to_id("<end_of_turn>")
    expected = [1, turn, *proc.encode("user\nhi there"), end, *proc.encode("\n")]
    expected += [turn, *proc.encode("model\n")]
    assert gguf_tok.encode(SPECIAL_TEXTS[0]) == expected
    assert gguf_tok.encode(SPECIAL_TEXTS[1], add_special_tokens=False) == [
        1, *proc.encode("text after bos"), 2, *proc.encode(" and after eos")
    ]  # fmt: skip
    tool = proc.piece_to_id("<tool>")  # user-defined: cut out like a control token, but kept in decode
    ids = gguf_tok.encode("a user-defined <tool> symbol", add_special_tokens=False)
    assert ids == [*proc.encode("a user-defined "), tool, *proc.encode(" symbol")]
    assert gguf_tok.decode(ids).replace(" ", "") == "auser-defined<tool>symbol"


def test_round_trip_and_streaming(spm_model: Path, gguf_tok: Tokenizer) -> None:
    for text in _all_texts():
        ids = gguf_tok.encode(text)
        assert gguf_tok.decode(ids) == text, repr(text)
        decoder = gguf_tok.incremental_decoder()
        deltas = [decoder.push(i) for i in ids] + [decoder.flush()]
        assert "".join(deltas) == gguf_tok.decode(ids, continuation=True)
        assert not any("\ufffd" in d for d in deltas), repr(text)
    for text in SPECIAL_TEXTS:
        ids = gguf_tok.encode(text, add_special_tokens=False)
        assert gguf_tok.decode(ids, skip_special_tokens=False).replace(" ", "") == text.replace(" ", "")


def test_byte_fallback_characters_stream_whole(gguf_tok: Tokenizer) -> None:
    ids = gguf_tok.encode("🦀", add_special_tokens=False)
    vocab = gguf_tok.backend.get_vocab()
    crab = [vocab[f"<0x{b:02X}>"] for b in "🦀".encode()]
    assert ids[-4:] == crab  # not in the vocabulary: its four UTF-8 bytes
    decoder = gguf_tok.incremental_decoder()
    deltas = [decoder.push(i) for i in crab]
    assert deltas == ["", "", "", "🦀"]
    assert [gguf_tok.token_text(i) for i in crab][0] == "bytes:\\xf0"


def test_continuation_keeps_the_prefix_space(spm_model: Path, gguf_tok: Tokenizer) -> None:
    ids = gguf_tok.encode("Hello world", add_special_tokens=False)
    assert gguf_tok.decode(ids) == "Hello world"
    expected = " Hello world" if _prefix(spm_model) else "Hello world"
    assert gguf_tok.decode(ids, continuation=True) == expected  # a completion keeps its leading space
    decoder = gguf_tok.incremental_decoder()
    assert "".join([decoder.push(i) for i in ids] + [decoder.flush()]) == expected


def test_bos_eos_flags(spm_model: Path, tmp_path: Path) -> None:
    proc = _processor(spm_model)
    default = _gguf_tokenizer(spm_model, tmp_path / "a", add_bos=None, add_eos=None, pre=None)
    assert default.encode("hi") == [1, *proc.encode("hi")]  # llama.cpp's defaults: BOS, no EOS
    both = _gguf_tokenizer(spm_model, tmp_path / "b", add_bos=False, add_eos=True)
    assert both.encode("hi") == [*proc.encode("hi"), 2] and both.encode("hi</s>") == [*proc.encode("hi"), 2]
    assert both.encode("hi", add_special_tokens=False) == proc.encode("hi")


def test_chat_template_and_end_of_turn_from_the_file(spm_model: Path, gguf_tok: Tokenizer) -> None:
    rendered = gguf_tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert rendered == "<s><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    end = _processor(spm_model).piece_to_id("<end_of_turn>")
    assert set(gguf_tok.eos_token_ids) == {2, end}
    assert gguf_tok.encode(rendered)[:2] == [1, 3]  # BOS written by the template is not doubled


def test_phi3_files_strip_whitespace_after_specials(spm_model: Path, tmp_path: Path) -> None:
    proc = _processor(spm_model)
    phi3 = _gguf_tokenizer(spm_model, tmp_path, name="Phi-3-mini")
    end = proc.piece_to_id("<end_of_turn>")
    expected = [end, *proc.encode("spaces after a special")]
    assert phi3.encode(SPECIAL_TEXTS[2], add_special_tokens=False) == expected


def test_end_of_turn_is_special_whatever_its_type(spm_model: Path, tmp_path: Path) -> None:
    """A file that types <end_of_turn> as user-defined (llama.cpp overrides it to control): it is still
    parsed from text, skipped when decoding, and stops generation (the template writes it)."""
    tok = _gguf_tokenizer(spm_model, tmp_path, type_overrides={"<end_of_turn>": 4}, pre=None)
    end = _processor(spm_model).piece_to_id("<end_of_turn>")
    ids = tok.encode("hi<end_of_turn>", add_special_tokens=False)
    assert ids[-1] == end and end in tok.eos_token_ids
    assert tok.decode(ids) == "hi" and tok.decode(ids, skip_special_tokens=False) == "hi<end_of_turn>"


def _transformers_reference(model_path: Path) -> Any:
    """transformers' tokenizer for the model: Llama's legacy conversion (Prepend + Replace normalizer,
    byte fallback; how Llama 2 / Mistral / Phi-3 tokenizer.json files are built) when it has the dummy
    prefix, GemmaTokenizer otherwise; vocab and merges from transformers' SentencePiece extractor."""
    import transformers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models
    from transformers.convert_slow_tokenizer import LlamaConverter, SentencePieceExtractor

    # transformers annotates extract() as returning a tuple; it returns the tokenizer's kwargs
    extracted: dict[str, Any] = SentencePieceExtractor(str(model_path)).extract(models.BPE)  # type: ignore[assignment]
    vocab, merges = extracted["vocab"], extracted["merges"]
    if not _prefix(model_path):
        return transformers.GemmaTokenizer(
            vocab=vocab, merges=merges, bos_token="<s>", eos_token="</s>", pad_token="<unk>",
            mask_token="<unk>", additional_special_tokens=extracted["additional_special_tokens"],
        )  # fmt: skip
    backend = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    stub = type("Converter", (), {"original_tokenizer": type("Slow", (), {"legacy": True})()})()
    backend.normalizer = LlamaConverter.normalizer(stub, None)
    backend.decoder = LlamaConverter.decoder(stub, "▁", True)
    backend.add_tokens(extracted["additional_special_tokens"])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")


def test_ids_equal_transformers(spm_model: Path, gguf_tok: Tokenizer, tmp_path: Path) -> None:
    reference = _transformers_reference(spm_model)
    for text in _all_texts() + SPECIAL_TEXTS[:2] + _piece_soup(gguf_vocab(spm_model)[0], 300):
        expected = reference.encode(text, add_special_tokens=False)
        assert gguf_tok.encode(text, add_special_tokens=False) == expected, repr(text)
        assert gguf_tok.decode(expected) == reference.decode(expected, skip_special_tokens=True)
    # an HF directory with that tokenizer.json loads to the same ids
    hf_dir = write_spm_hf_dir(tmp_path / "hf", spm_model, add_bos_token=True).path
    reference.backend_tokenizer.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer.model").unlink()
    from_hf = load_model(str(hf_dir)).tokenizer
    for text in _all_texts() + SPECIAL_TEXTS[:2]:
        ids = from_hf.encode(text)
        assert ids == gguf_tok.encode(text) and from_hf.decode(ids) == gguf_tok.decode(ids), repr(text)
        assert from_hf.decode(ids, continuation=True) == gguf_tok.decode(ids, continuation=True)


def test_hf_directory_with_only_tokenizer_model(spm_model: Path, gguf_tok: Tokenizer, tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    hf_dir = write_spm_hf_dir(tmp_path / "hf", spm_model, chat_template=template, add_eos_token=True).path
    loaded = load_model(str(hf_dir))
    tok = loaded.tokenizer
    assert (tok.bos_token_id, tok.eos_token_ids, tok.chat_template) == (1, (2,), template)
    assert hf_dir / "tokenizer.model" in loaded.artifacts
    for text in _all_texts() + SPECIAL_TEXTS:
        assert tok.encode(text) == [*gguf_tok.encode(text), 2], repr(text)
    # tokenizer_config's add_prefix_space overrides the model's dummy prefix, as llama.cpp's converter does
    flipped = write_spm_hf_dir(tmp_path / "flip", spm_model, add_prefix_space=not _prefix(spm_model)).path
    assert load_model(str(flipped)).tokenizer.encode("hi") != tok.encode("hi")[:-1]


def test_bad_sentencepiece_inputs_are_refused(spm_model: Path, tmp_path: Path) -> None:
    import gguf

    from tests.spm_models import write_spm_metadata

    path = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    write_spm_metadata(writer, spm_model)
    writer.add_array("tokenizer.ggml.scores", [0.0])  # overrides the scores with a short list
    from deterministic_inference.model.gguf_file import read_gguf
    from deterministic_inference.model.gguf_tokenizer import build_gguf_tokenizer

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.scores has 1 entries"):
        build_gguf_tokenizer(path, read_gguf(path).metadata)
    hf_dir = write_spm_hf_dir(tmp_path / "hf", spm_model).path
    (hf_dir / "tokenizer.model").write_bytes(b"\x0a\xff")
    with pytest.raises(ModelLoadError, match="tokenizer.model: not a readable SentencePiece model"):
        load_model(str(hf_dir))


def test_unigram_model_is_refused(tmp_path: Path) -> None:
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()), model_writer=model, model_type="unigram", vocab_size=200,
        num_threads=1, minloglevel=2,
    )  # fmt: skip
    hf_dir = write_spm_hf_dir(tmp_path / "hf", train_spm(tmp_path / "bpe")).path
    (hf_dir / "tokenizer.model").write_bytes(model.getvalue())
    with pytest.raises(ModelLoadError, match="model type 1 is not supported"):
        load_model(str(hf_dir))


def test_tokenizer_json_is_written_by_the_reference(tmp_path: Path) -> None:
    """The HF-directory path reads real Llama-style tokenizer.json files: the decoder's Strip is what
    makes `decode` drop the prefix space, and `continuation` keep it."""
    model_path = train_spm(tmp_path / "m")
    saved = tmp_path / "tokenizer.json"
    _transformers_reference(model_path).backend_tokenizer.save(str(saved))
    decoder = json.loads(saved.read_text())["decoder"]
    assert [d["type"] for d in decoder["decoders"]] == ["Replace", "ByteFallback", "Fuse", "Strip"]
