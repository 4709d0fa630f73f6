"""Hostile request bodies for every endpoint with a body: each must get a 4xx OpenAI error, never a 5xx.

Bodies are raw bytes: JSON with `ensure_ascii` (so a lone surrogate travels as the escape "\\udcff", the
way the issue's `curl -d '{"text": "\\udcff"}'` sends it), or bytes that are not JSON / not UTF-8.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

LONE = "\udcff"  # a lone low surrogate
HIGH = "\ud800"  # a lone high surrogate
MEGABYTE_TEXT = "lorem ipsum " * 87_382  # ~1 MB of text, far beyond the tiny model's 512-token context
CHAT = [{"role": "user", "content": "Hi"}]


@dataclass(frozen=True)
class Hostile:
    """One hostile request: where it goes, its raw body, the param the 400 must name (if any)."""

    name: str
    path: str
    body: bytes
    param: str | None = None  # expected `error.param` (prefix match), None = not checked


def raw(document: Any) -> bytes:
    """JSON bytes with every non-ASCII character escaped (lone surrogates included)."""
    return json.dumps(document).encode("ascii")


def _completions() -> list[Hostile]:
    p = "/v1/completions"
    return [
        Hostile("cmpl surrogate prompt", p, raw({"prompt": LONE}), "prompt"),
        Hostile("cmpl surrogate in prompt list", p, raw({"prompt": ["ok", f"a{HIGH}b"]}), "prompt[1]"),
        Hostile("cmpl NUL prompt", p, raw({"prompt": "a\x00b"}), "prompt"),
        Hostile("cmpl surrogate stop", p, raw({"prompt": "x", "stop": LONE}), "stop"),
        Hostile("cmpl surrogate stop list", p, raw({"prompt": "x", "stop": ["a", LONE]}), "stop[1]"),
        Hostile("cmpl surrogate user", p, raw({"prompt": "x", "user": LONE}), "user"),
        Hostile(
            "cmpl surrogate logit_bias key", p, raw({"prompt": "x", "logit_bias": {LONE: 1}}), "logit_bias"
        ),
        Hostile("cmpl surrogate model", p, raw({"model": LONE, "prompt": "x"}), "model"),
        Hostile("cmpl surrogate unknown key", p, raw({"prompt": "x", LONE: 1}), None),
        Hostile("cmpl 1 MB prompt", p, raw({"prompt": MEGABYTE_TEXT, "max_tokens": 2}), "prompt"),
        Hostile("cmpl 200k token ids", p, raw({"prompt": [5] * 200_000}), "prompt"),
        Hostile("cmpl token id beyond vocab", p, raw({"prompt": [0, 10**9]}), "prompt"),
        Hostile("cmpl negative token id", p, raw({"prompt": [0, -1]}), "prompt"),
        Hostile("cmpl 2**70 token id", p, raw({"prompt": [2**70]}), "prompt"),
        Hostile("cmpl huge n", p, raw({"prompt": "x", "n": 10**9}), "n"),
        Hostile("cmpl huge max_tokens", p, raw({"prompt": "x", "max_tokens": 10**12}), "max_tokens"),
        Hostile("cmpl huge logprobs", p, raw({"prompt": "x", "logprobs": 10**6}), "logprobs"),
        Hostile("cmpl huge best_of", p, raw({"prompt": "x", "best_of": 10**9}), "best_of"),
        Hostile("cmpl huge seed", p, raw({"prompt": "x", "seed": 2**80}), "seed"),
        Hostile("cmpl many stops", p, raw({"prompt": "x", "stop": ["s"] * 1000}), "stop"),
        Hostile("cmpl prompt number", p, raw({"prompt": 5}), "prompt"),
        Hostile("cmpl prompt object", p, raw({"prompt": {"a": 1}}), "prompt"),
        Hostile("cmpl n string", p, raw({"prompt": "x", "n": "2"}), "n"),
        Hostile("cmpl echo string", p, raw({"prompt": "x", "echo": "yes"}), "echo"),
        Hostile("cmpl temperature list", p, raw({"prompt": "x", "temperature": [1]}), "temperature"),
        Hostile("cmpl NaN temperature", p, b'{"prompt": "x", "temperature": NaN}', "temperature"),
        Hostile("cmpl truncated", p, b'{"prompt": "abc', None),
        Hostile("cmpl truncated escape", p, b'{"prompt": "\\ud', None),
        Hostile("cmpl not utf-8", p, b'{"prompt": "\xff\xfe"}', None),
        Hostile("cmpl raw surrogate bytes", p, b'{"prompt": "\xed\xb3\xbf"}', None),
        Hostile("cmpl empty body", p, b"", None),
        Hostile("cmpl deep nesting", p, b"[" * 100_000, None),
        Hostile("cmpl 5000-digit integer", p, b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", None),
    ]


def _chat() -> list[Hostile]:
    p = "/v1/chat/completions"

    def message(**fields: Any) -> bytes:
        return raw({"messages": [{"role": "user", "content": "Hi", **fields}]})

    return [
        Hostile("chat surrogate content", p, message(content=LONE), "messages[0].content"),
        Hostile("chat NUL content", p, message(content="a\x00"), "messages[0].content"),
        Hostile("chat surrogate name", p, message(name=LONE), "messages[0].name"),
        Hostile(
            "chat surrogate role", p, raw({"messages": [{"role": LONE, "content": "x"}]}), "messages[0].role"
        ),
        Hostile(
            "chat surrogate text part",
            p,
            raw({"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]}),
            "messages[0].content[0].text",
        ),
        Hostile("chat surrogate stop", p, raw({"messages": CHAT, "stop": [LONE]}), "stop[0]"),
        Hostile("chat surrogate user", p, raw({"messages": CHAT, "user": LONE}), "user"),
        Hostile(
            "chat surrogate logit_bias key", p, raw({"messages": CHAT, "logit_bias": {LONE: 5}}), "logit_bias"
        ),
        Hostile("chat 1 MB message", p, message(content=MEGABYTE_TEXT), "messages"),
        Hostile("chat 20k messages", p, raw({"messages": CHAT * 20_000}), "messages"),
        Hostile("chat huge n", p, raw({"messages": CHAT, "n": 10**9}), "n"),
        Hostile("chat huge max_tokens", p, raw({"messages": CHAT, "max_tokens": 10**12}), "max_tokens"),
        Hostile(
            "chat huge top_logprobs",
            p,
            raw({"messages": CHAT, "logprobs": True, "top_logprobs": 10**6}),
            None,
        ),
        Hostile("chat messages string", p, raw({"messages": "hello"}), "messages"),
        Hostile("chat message number", p, raw({"messages": [5]}), "messages[0]"),
        Hostile("chat content number", p, message(content=5), "messages[0].content"),
        Hostile("chat truncated", p, b'{"messages": [{"role": "user", "content": "a', None),
        Hostile("chat not utf-8", p, b'{"messages": "\xc3\x28"}', None),
    ]


def _generate() -> list[Hostile]:
    p = "/generate"

    def sampling(**fields: Any) -> bytes:
        return raw({"text": "x", "sampling_params": fields})

    return [
        Hostile("gen surrogate text", p, raw({"text": LONE}), "text"),
        Hostile("gen surrogate in text batch", p, raw({"text": ["a", LONE]}), "text[1]"),
        Hostile("gen NUL text", p, raw({"text": "\x00"}), "text"),
        Hostile("gen surrogate stop", p, sampling(stop=LONE), "sampling_params.stop"),
        Hostile("gen 1 MB text", p, raw({"text": MEGABYTE_TEXT}), "text"),
        Hostile("gen input_ids beyond vocab", p, raw({"input_ids": [1, 10**9]}), "input_ids"),
        Hostile("gen negative input_ids", p, raw({"input_ids": [[1, 2], [-5]]}), "input_ids"),
        Hostile("gen huge n", p, sampling(n=10**9), "n"),
        Hostile(
            "gen huge max_new_tokens", p, sampling(max_new_tokens=10**12), "sampling_params.max_new_tokens"
        ),
        Hostile(
            "gen huge top_logprobs_num",
            p,
            raw({"text": "x", "return_logprob": True, "top_logprobs_num": 10**6}),
            None,
        ),
        Hostile("gen seed string", p, sampling(sampling_seed="1"), "sampling_params.sampling_seed"),
        Hostile("gen sampling_params list", p, raw({"text": "x", "sampling_params": [1]}), "sampling_params"),
        Hostile("gen text and input_ids", p, raw({"text": "x", "input_ids": [1]}), "text"),
        Hostile("gen truncated", p, b'{"text": ', None),
        Hostile("gen not utf-8", p, b'{"text": "\x80"}', None),
        Hostile("gen not an object", p, b"[1, 2, 3]", None),
    ]


def hostile_requests() -> list[Hostile]:
    """Every hostile case, for /v1/completions, /v1/chat/completions and /generate."""
    return _completions() + _chat() + _generate()
