"""The tokenizer every loader returns: a `tokenizers.Tokenizer` plus the model's special-token rules.

Encoding never runs the backend's post-processor: BOS is added here, and only when the model's metadata
asks for it, so GGUF and HF sources of one model produce the same ids. Decoding is the backend's; the
incremental decoder streams text whose concatenation equals the full decode.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import tokenizers

from deterministic_inference.errors import InvalidRequestError
from deterministic_inference.model.chat_template import ChatTemplate

# Special tokens that end an assistant turn in common chat templates; they stop generation when the
# template uses them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|eom_id|>")

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def byte_level_alphabet() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE (GPT-2 style).

    Printable Latin-1 bytes map to themselves; the other 68 bytes map, in byte order, to U+0100 onwards.
    """
    table: dict[int, str] = {}
    extra = 0
    for byte in range(256):
        printable = 0x21 <= byte <= 0x7E or 0xA1 <= byte <= 0xAC or 0xAE <= byte <= 0xFF
        if printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(0x100 + extra)
            extra += 1
    return table


def _is_byte_level(backend: tokenizers.Tokenizer) -> bool:
    # the decoder's own JSON (the whole tokenizer's, with a 49k vocabulary, took ~0.4 s to parse)
    decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else {}
    if decoder.get("type") == "ByteLevel":
        return True
    return any(d.get("type") == "ByteLevel" for d in decoder.get("decoders", []) or [])


def end_of_turn_ids(backend: tokenizers.Tokenizer, template: str | None) -> set[int]:
    """Ids of the end-of-turn tokens the chat template writes (they must stop generation)."""
    if not template:
        return set()
    ids = set()
    for text in END_OF_TURN_TOKENS:
        token_id = backend.token_to_id(text)
        if text in template and token_id is not None:
            ids.add(int(token_id))
    return ids


class Tokenizer:
    """A model's tokenizer: ids <-> text, special tokens, chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos: bool,
        chat_template: str | None,
    ) -> None:
        self.backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._special: dict[int, str] = {
            i: t.content for i, t in backend.get_added_tokens_decoder().items() if t.special
        }
        self._byte_level = _is_byte_level(backend)
        self._unbyte = {ch: b for b, ch in byte_level_alphabet().items()}
        bos_text = self._special_text(bos_token_id)
        eos_text = self._special_text(self.eos_token_ids[0] if self.eos_token_ids else None)
        self._template = ChatTemplate(chat_template, bos_text, eos_text) if chat_template else None

    def _special_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    @property
    def special_token_ids(self) -> tuple[int, ...]:
        """Ids of the special (control) tokens, ascending."""
        return tuple(sorted(self._special))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings in it become their ids.

        With add_special_tokens, BOS is prepended when the model's metadata says so, unless the text
        already starts with it (a chat template that writes BOS itself)."""
        ids: list[int] = self.backend.encode(text, add_special_tokens=False).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; bytes that do not form valid UTF-8 become U+FFFD."""
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (a special token: its text in UTF-8)."""
        if token_id in self._special:
            return self._special[token_id].encode()
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(ch in self._unbyte for ch in piece):
            return bytes(self._unbyte[ch] for ch in piece)
        match = _BYTE_TOKEN.match(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    def token_text(self, token_id: int) -> str:
        """Text of a single token (top_logprobs keys). A token whose bytes are not valid UTF-8 on
        their own is written like OpenAI does: "bytes:\\xe2\\x80". Ids outside the vocab give ""."""
        if token_id < 0:
            raise InvalidRequestError(f"token id {token_id} is negative", param="token_id")
        data = self.token_bytes(token_id)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text of a conversation (`tools`: OpenAI tool definitions, for templates that render
        them). Encode it with add_special_tokens=False or True: BOS is never doubled.
        InvalidRequestError when the model has no template or the template rejects it."""
        if self._template is None:
            raise InvalidRequestError(
                "messages: this model has no chat template; use the completions endpoint with a prompt",
                param="messages",
            )
        return self._template.render(messages, add_generation_prompt, tools)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """A fresh streaming decoder over this tokenizer."""
        return IncrementalDecoder(self, skip_special_tokens)


class IncrementalDecoder:
    """Streams text token by token; the pushes plus `flush()` concatenate to `decode(all ids)`.

    Each push decodes a short window (the tokens of the previous delta plus the new ones), so leading
    spaces that some decoders strip at the start of a text are kept, and holds text back while it ends
    in an incomplete UTF-8 sequence (U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: first token of the previous delta
        self._read_offset = 0  # tokens already turned into emitted text
        self._emitted: list[str] = []

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], self._skip)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is still partial)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        window_text = self._decode(self._prefix_offset, len(self._ids))
        if window_text.endswith("\ufffd") or not window_text.startswith(prefix_text):
            return ""
        delta = window_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._emitted.append(delta)
        return delta

    def flush(self) -> str:
        """The text still held back; after this, the emitted text equals the full decode."""
        full = self._tokenizer.decode(self._ids, self._skip)
        done = "".join(self._emitted)
        rest = full[len(done) :] if full.startswith(done) else ""
        self._emitted.append(rest)
        self._prefix_offset = self._read_offset = len(self._ids)
        return rest
