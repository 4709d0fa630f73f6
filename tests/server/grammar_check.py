"""A byte-level llguidance tokenizer (256 byte tokens + EOS) to check what a grammar accepts, without a
model: one token per byte, so any text can be fed."""

from __future__ import annotations

from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper


class _Bytes:
    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


BYTE_TOKENIZER = LLTokenizer(TokenizerWrapper(_Bytes()))


def lark_accepts(grammar: str, text: str) -> bool:
    """True when the Lark grammar accepts exactly `text` (every byte consumed, then it may stop)."""
    matcher = LLMatcher(BYTE_TOKENIZER, LLMatcher.grammar_from_lark(grammar), log_level=0)
    consumed = matcher.consume_tokens(list(text.encode()))
    return bool(consumed) and not matcher.is_error() and matcher.is_accepting()
