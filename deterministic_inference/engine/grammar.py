"""Grammar compilation for structured outputs: `StructuredOutput` -> a compiled llguidance grammar.

`GrammarCompiler` is built once per engine from its `Tokenizer`: every token id of the model's logits row
is mapped to the exact bytes it stands for (`Tokenizer.token_bytes`: byte-level BPE pieces, SentencePiece
`<0xXX>` byte-fallback tokens and U+2581 pieces alike), special tokens marked with a leading 0xFF byte as
llguidance expects (a grammar only allows them when it names them), ids past the tokenizer's vocabulary
(padding rows of the logits) as empty tokens that no grammar allows.

`compile(spec)` is thread-safe and cached by (spec digest, vocabulary digest), so each grammar compiles
once per engine; failures are cached too (a client repeating a bad body costs nothing). Compilation is
bounded by llguidance's parser limits (fuel, grammar size, lexer states: operation counts, not time, so
those bounds are the same on every run), by `MAX_SOURCE_BYTES`, and by `MAX_COMPILE_SECONDS` of wall time
for the build and the first mask (native code cannot be interrupted, so the time is spent once and the
refusal cached; a refused grammar never reaches the engine, so no accepted output depends on timing).
Every failure raises `InvalidRequestError` saying what is wrong. The server calls it in a worker thread
before admitting a request (llguidance releases the GIL while it builds), so a slow compile never stalls
other requests' steps.

A `CompiledGrammar` hands out one fresh matcher per sequence (`new_matcher`): a matcher built from the
grammar text alone, never a copy sharing another sequence's lazily built lexer state, so a sequence's
masks are a function of its grammar and its own tokens only.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from deterministic_inference.engine.structured_spec import StructuredOutput
from deterministic_inference.errors import InvalidRequestError
from deterministic_inference.model.tokenizer import Tokenizer

MAX_SOURCE_BYTES = 128 << 10  # largest grammar / schema text accepted (128 KiB)
MAX_COMPILE_SECONDS = 2.0  # a grammar whose build + first mask takes longer is refused
MAX_CACHED = 512  # compiled grammars kept per engine (least recently used dropped first)
_MAX_MESSAGE = 400  # characters of llguidance's error text quoted back to the client
_SPECIAL_MARK = b"\xff"  # llguidance: a token whose bytes start with 0xFF is a special token
# JSON (documented choice): no free whitespace, Python's json.dumps separators (", " and ": "), so a model
# cannot loop on blank lines and answers read like ordinary JSON; a schema's "x-guidance" key overrides it.
_JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_DIGEST_DOMAIN = b"detinf-grammar-vocabulary-v1\x00"


def _limits() -> llguidance.LLParserLimits:
    """llguidance's parser limits (its defaults: operation counts, deterministic), errors kept short."""
    return llguidance.LLParserLimits(verbose_errors=False)


def vocabulary_bytes(tokenizer: Tokenizer, vocab_size: int) -> list[bytes]:
    """Bytes of every token id in [0, vocab_size): special tokens prefixed with 0xFF, ids the tokenizer
    does not have as b"" (llguidance never allows an empty token)."""
    special = set(tokenizer.special_token_ids)
    tokens: list[bytes] = []
    for token_id in range(vocab_size):
        if token_id >= tokenizer.vocab_size:
            tokens.append(b"")
        elif token_id in special:
            tokens.append(_SPECIAL_MARK + tokenizer.token_bytes(token_id))
        else:
            tokens.append(tokenizer.token_bytes(token_id))
    return tokens


def vocabulary_digest(tokens: Sequence[bytes], eos_token_ids: Sequence[int]) -> str:
    """sha256 over the token bytes (length-prefixed, in id order) and the EOS ids: equal vocabularies
    give equal digests in every process."""
    outer = hashlib.sha256(_DIGEST_DOMAIN)
    for token in tokens:
        outer.update(len(token).to_bytes(4, "big") + token)
    outer.update(b"eos:" + ",".join(str(t) for t in eos_token_ids).encode())
    return outer.hexdigest()


class _TokenizerAdapter:
    """What `llguidance.TokenizerWrapper` reads: token bytes, special ids, EOS/BOS, and an encoder."""

    def __init__(self, tokenizer: Tokenizer, tokens: list[bytes], eos_token_id: int) -> None:
        self.tokens = tokens
        self.eos_token_id = eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = list(tokenizer.special_token_ids)
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._tokenizer.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated grammar for one (spec, vocabulary): llguidance's grammar text, ready for matchers."""

    spec: StructuredOutput
    grammar: str  # llguidance grammar (Lark text or its JSON form)
    tokenizer: llguidance.LLTokenizer

    def new_matcher(self) -> llguidance.LLMatcher:
        """A fresh matcher in the grammar's start state (its own lexer and parser state)."""
        return llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0, limits=_limits())


class GrammarCompiler:
    """Compiles `StructuredOutput`s against one vocabulary; thread-safe, cached (module docstring)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        tokens = vocabulary_bytes(tokenizer, vocab_size)
        eos = list(tokenizer.eos_token_ids)
        self.vocab_size = vocab_size  # width of the logits rows the masks apply to
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self.special_texts = {
            tokenizer.token_bytes(i).decode("utf-8", "replace") for i in tokenizer.special_token_ids
        }
        self.vocabulary_digest = vocabulary_digest(tokens, eos)
        wrapper = llguidance.TokenizerWrapper(_TokenizerAdapter(tokenizer, tokens, eos[0] if eos else 0))
        self.lltokenizer = llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos or None)
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar of `spec` (compiled at most once; concurrent callers wait for the first).
        Raises InvalidRequestError naming what is wrong with the constraint."""
        key = (spec.digest(), self.vocabulary_digest)
        with self._lock:
            future = self._cache.get(key)
            owner = future is None
            if future is None:
                future = self._cache[key] = Future()
                while len(self._cache) > MAX_CACHED:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        if owner:
            try:
                future.set_result(self._build(spec))
            except InvalidRequestError as error:
                future.set_exception(error)
            except Exception as error:  # noqa: BLE001 - any grammar-engine failure is the request's
                future.set_exception(_invalid(spec, f"{type(error).__name__}: {error}"))
        return future.result()

    def cached(self, spec: StructuredOutput) -> bool:
        """True when `spec` was compiled (successfully or not) and is still cached."""
        with self._lock:
            return (spec.digest(), self.vocabulary_digest) in self._cache

    def _build(self, spec: StructuredOutput) -> CompiledGrammar:
        if len(spec.source.encode("utf-8")) > MAX_SOURCE_BYTES:
            raise _invalid(spec, f"the source is larger than {MAX_SOURCE_BYTES} bytes")
        grammar = self._grammar_text(spec)
        started = time.monotonic()
        matcher = llguidance.LLMatcher(self.lltokenizer, grammar, log_level=0, limits=_limits())
        matcher.compute_bitmask()  # the first mask builds the lexer: errors and cost show here
        if matcher.is_error():
            raise _invalid(spec, matcher.get_error())
        seconds = time.monotonic() - started
        if seconds > MAX_COMPILE_SECONDS:
            raise _invalid(
                spec,
                f"the grammar is too complex: compiling it took {seconds:.1f} s, "
                f"over the {MAX_COMPILE_SECONDS:.0f} s limit; simplify it",
            )
        return CompiledGrammar(spec, grammar, self.lltokenizer)

    def _grammar_text(self, spec: StructuredOutput) -> str:
        """llguidance grammar text of a spec (errors in the source text itself raise here)."""
        kind, source = spec.kind, spec.source
        if kind == "json_schema":
            schema = _json_value(spec, source)
            if not isinstance(schema, dict | bool):
                raise _invalid(spec, "the schema must be a JSON object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_DEFAULTS)  # type: ignore[arg-type]
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_DEFAULTS)  # type: ignore[arg-type]
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(source)
        if kind == "choice":
            return _choice_grammar(spec)
        if kind == "ebnf":
            try:
                return llguidance.LLMatcher.grammar_from_lark(any_to_lark(source))
            except Exception as error:  # noqa: BLE001 - the converter's error names the grammar's fault
                raise _invalid(spec, str(error)) from None
        if kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(source)
        return self._structural_tag_grammar(spec)

    def _structural_tag_grammar(self, spec: StructuredOutput) -> str:
        """vLLM's structural-tag shape: {"structures": [{"begin", "schema", "end"}], "triggers": [...]};
        text is free until a trigger, then the structure whose `begin` starts with it is enforced."""
        value = _json_value(spec, spec.source)
        if not isinstance(value, dict) or not isinstance(value.get("structures"), list):
            raise _invalid(spec, 'expected an object with a "structures" list and a "triggers" list')
        triggers = value.get("triggers")
        if (
            not isinstance(triggers, list)
            or not triggers
            or not all(isinstance(t, str) and t for t in triggers)
        ):
            raise _invalid(spec, '"triggers" must be a non-empty list of non-empty strings')
        tags = []
        for index, structure in enumerate(value["structures"]):
            if not isinstance(structure, dict):
                raise _invalid(spec, f"structures[{index}] must be an object")
            begin, end, schema = structure.get("begin"), structure.get("end", ""), structure.get("schema")
            if not isinstance(begin, str) or not isinstance(end, str) or not isinstance(schema, dict | bool):
                raise _invalid(spec, f"structures[{index}] needs string begin/end and an object schema")
            trigger = next((t for t in triggers if begin.startswith(t)), None)
            if trigger is None:
                raise _invalid(spec, f"structures[{index}].begin {begin!r} starts with none of the triggers")
            tags.append(
                llguidance.StructTag(trigger=trigger, begin=begin, grammar=json.dumps(schema), end=end)
            )
        if not tags:
            raise _invalid(spec, '"structures" is empty')
        special = all(t in self.special_texts for t in triggers)
        return llguidance.StructTag.to_grammar(tags, assume_special=special)


def _choice_grammar(spec: StructuredOutput) -> str:
    choices = _json_value(spec, spec.source)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise _invalid(spec, "expected a non-empty JSON array of strings")
    if any(not c for c in choices):
        raise _invalid(spec, "a choice is the empty string")
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def _json_value(spec: StructuredOutput, source: str) -> Any:
    try:
        return json.loads(source)
    except ValueError as error:
        raise _invalid(spec, f"not valid JSON ({error})") from None


def _invalid(spec: StructuredOutput, reason: str) -> InvalidRequestError:
    """The one error for a constraint that cannot be used: what kind, and llguidance's reason (cut)."""
    reason = " ".join(reason.split())
    if len(reason) > _MAX_MESSAGE:
        reason = reason[:_MAX_MESSAGE] + "..."
    return InvalidRequestError(f"structured output ({spec.kind}): {reason}")
