"""Tokenizer: incremental decoding, token_text, BOS rules, chat template."""

from __future__ import annotations

import pytest

from deterministic_inference.errors import InvalidRequestError
from deterministic_inference.model.loader import load_model
from deterministic_inference.model.tokenizer import Tokenizer, byte_level_alphabet
from tests.tiny_models import TinyModel

TEXTS = [
    "Hello, world!",
    "def add(a, b):\n    return a + b\n",
    "Grüße — 你好世界 🙂🙃 ça va? ключ",
    "🙂",
    "  two leading spaces",
]


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: TinyModel) -> Tokenizer:
    return load_model(str(tiny_llama_dir.path)).tokenizer


@pytest.fixture(scope="module")
def qwen_tok(tiny_qwen3_dir: TinyModel) -> Tokenizer:
    return load_model(str(tiny_qwen3_dir.path)).tokenizer


def _stream(tok: Tokenizer, ids: list[int], skip: bool = True) -> list[str]:
    decoder = tok.incremental_decoder(skip_special_tokens=skip)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_decode_equals_full_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    deltas = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_multibyte_characters_split_across_tokens_are_held_back(tok: Tokenizer) -> None:
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) == 4  # the tiny vocab has no merges for it: one token per UTF-8 byte
    assert _stream(tok, ids) == ["", "", "", "🙂", ""]


def test_incremental_decode_with_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi 你好<|im_end|>")
    assert "".join(_stream(tok, ids, skip=False)) == "<|endoftext|><|im_start|>user\nhi 你好<|im_end|>"
    assert "".join(_stream(tok, ids)) == "user\nhi 你好"


def test_flush_returns_an_incomplete_tail(tok: Tokenizer) -> None:
    ids = tok.encode("ab🙂", add_special_tokens=False)[:-1]  # cut the emoji's last byte
    deltas = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) and deltas[-1].endswith("\ufffd")


def test_token_text(tok: Tokenizer) -> None:
    hello = tok.encode("Hello", add_special_tokens=False)
    assert "".join(tok.token_text(i) for i in hello) == "Hello"
    space_ids = tok.encode(" the", add_special_tokens=False)
    assert "".join(tok.token_text(i) for i in space_ids) == " the"
    assert [tok.token_text(i) for i in tok.encode("🙂", add_special_tokens=False)] == [
        "bytes:\\xf0",
        "bytes:\\x9f",
        "bytes:\\x99",
        "bytes:\\x82",
    ]
    assert tok.token_text(2) == "<|im_end|>"
    assert tok.token_text(tok.vocab_size + 5) == ""
    with pytest.raises(InvalidRequestError):
        tok.token_text(-1)


def test_byte_level_alphabet_is_a_bijection() -> None:
    table = byte_level_alphabet()
    assert len(set(table.values())) == 256
    assert table[ord("A")] == "A" and table[ord(" ")] == "\u0120" and table[ord("\n")] == "\u010a"


def test_bos_rules(tok: Tokenizer, qwen_tok: Tokenizer) -> None:
    ids = tok.encode("hi")
    assert ids[0] == 0 and tok.encode("hi", add_special_tokens=False) == ids[1:]
    assert tok.encode("<|endoftext|>hi") == ids  # BOS already there: not doubled
    assert qwen_tok.bos_token_id is None and qwen_tok.encode("hi") == qwen_tok.encode("hi", False)


def test_chat_template(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("Hi<|im_end|>\n")
    with pytest.raises(InvalidRequestError):
        tok.apply_chat_template([])


def _with_template(tok: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(tok.backend, bos_token_id=0, eos_token_ids=(2,), add_bos=False, chat_template=template)


def test_chat_template_errors(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(InvalidRequestError, match="no chat template"):
        _with_template(tok, None).apply_chat_template(messages)
    with pytest.raises(InvalidRequestError, match="does not compile"):
        _with_template(tok, "{% for %}").apply_chat_template(messages)
    rejecting = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('need a system message') }}{% endif %}"
    )
    with pytest.raises(InvalidRequestError, match="need a system message"):
        _with_template(tok, rejecting).apply_chat_template(messages)
    sandboxed = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(InvalidRequestError):
        _with_template(tok, sandboxed).apply_chat_template(messages)


def test_chat_template_helpers(tok: Tokenizer) -> None:
    template = "{{ bos_token }}{{ messages | tojson }}{{ eos_token }}"
    rendered = _with_template(tok, template).apply_chat_template([{"role": "user", "content": "<é>"}])
    assert rendered == '<|endoftext|>[{"role": "user", "content": "<é>"}]<|im_end|>'


@pytest.mark.slow
def test_real_model_incremental_decode() -> None:
    tok = load_model(None).tokenizer
    for text in TEXTS + ["Ελληνικά, עברית, हिन्दी, 😀👍🏽 and `code`!"]:
        ids = tok.encode(text)
        assert "".join(_stream(tok, ids)) == tok.decode(ids) == text
