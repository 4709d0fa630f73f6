"""GrammarCompiler: the vocabulary's exact bytes, compile-once caching, clear errors for bad constraints."""

from __future__ import annotations

import json
import threading

import pytest
import tokenizers
import torch

from deterministic_inference.engine import grammar
from deterministic_inference.engine.grammar import MAX_SOURCE_BYTES, GrammarCompiler, vocabulary_bytes
from deterministic_inference.engine.grammar_state import fill_bitmask, fill_bitmasks
from deterministic_inference.engine.structured_spec import StructuredOutput
from deterministic_inference.errors import InvalidRequestError
from deterministic_inference.model.loader import load_model
from deterministic_inference.model.tokenizer import Tokenizer
from tests.tiny_models import TinyModel

SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
)


@pytest.fixture(scope="module")
def compiler(tiny_llama_dir: TinyModel) -> GrammarCompiler:
    loaded = load_model(str(tiny_llama_dir.path))
    return GrammarCompiler(loaded.tokenizer, loaded.spec.vocab_size + 5)  # 5 padding ids past the vocab


def allowed_ids(compiler: GrammarCompiler, spec: StructuredOutput) -> list[int]:
    matcher = compiler.compile(spec).new_matcher()
    mask = fill_bitmask(matcher, compiler.vocab_size)  # [1, ceil(V / 32)] int32
    bits = (mask[0, :, None] >> torch.arange(32)) & 1  # [W, 32]
    return torch.nonzero(bits.flatten()[: compiler.vocab_size]).flatten().tolist()


def test_our_mask_fills_equal_llguidance_torch(compiler: GrammarCompiler) -> None:
    """fill_bitmask / fill_bitmasks (written without llguidance.torch, whose import costs seconds) give
    the very words llguidance's own torch helpers give, for two grammars, in one call and one by one."""
    import llguidance
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask, fill_next_token_bitmask_par

    specs = [StructuredOutput("json_schema", SCHEMA), StructuredOutput("regex", "[0-9]{3}-[a-z]{2}")]
    matchers = [compiler.compile(spec).new_matcher() for spec in specs]
    vocab = compiler.vocab_size
    reference = allocate_token_bitmask(len(matchers), vocab)
    fill_next_token_bitmask_par(llguidance.LLExecutor(), [(m, i) for i, m in enumerate(matchers)], reference)
    ours = fill_bitmasks(llguidance.LLExecutor(), matchers, vocab)
    assert torch.equal(ours, reference) and ours.shape == (2, (vocab + 31) // 32)
    for index, matcher in enumerate(matchers):
        single = allocate_token_bitmask(1, vocab)
        fill_next_token_bitmask(matcher, single, 0)
        assert torch.equal(fill_bitmask(matcher, vocab), single) and torch.equal(single[0], reference[index])
    assert not torch.equal(reference[0], reference[1])  # two grammars, two masks: the check can fail


def test_byte_level_vocabulary_maps_every_token_to_its_bytes(tiny_llama_dir: TinyModel) -> None:
    tokenizer = load_model(str(tiny_llama_dir.path)).tokenizer
    tokens = vocabulary_bytes(tokenizer, tokenizer.vocab_size + 2)
    for text in ("def add(a, b):\n    return a + b", "héllo wörld €5 — ok", '{"k": [1, 2.5e-3]}'):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(tokens[i] for i in ids) == text.encode()
    assert tokenizer.special_token_ids
    assert all(tokens[i].startswith(b"\xff") for i in tokenizer.special_token_ids)
    assert tokens[-2:] == [b"", b""]


def test_sentencepiece_byte_fallback_and_word_boundary_pieces() -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<0x0A>": 3, "<0xE2>": 4, "\u2581hello": 5, "world": 6}
    backend = tokenizers.Tokenizer(
        tokenizers.models.Unigram([(p, 0.0) for p in vocab], 0, byte_fallback=True)
    )
    backend.normalizer = tokenizers.normalizers.Replace(" ", "\u2581")
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer = Tokenizer(backend, bos_token_id=1, eos_token_ids=[2], add_bos=True, chat_template=None)
    tokens = vocabulary_bytes(tokenizer, 7)
    assert tokens[3] == b"\n" and tokens[4] == b"\xe2"
    assert tokens[5] == b" hello" and tokens[6] == b"world"
    assert tokens[2] == b"\xff</s>"
    compiler = GrammarCompiler(tokenizer, 7)
    assert allowed_ids(compiler, StructuredOutput("regex", " hello(world)?")) == [5]


def test_mask_allows_exactly_the_grammar_and_never_padding(compiler: GrammarCompiler) -> None:
    allowed = allowed_ids(compiler, StructuredOutput("json_schema", SCHEMA))
    tokens = vocabulary_bytes_of(compiler)
    assert allowed and all(tokens[i] and (tokens[i].lstrip().startswith(b"{")) for i in allowed)
    assert not set(allowed) & set(range(compiler.vocab_size - 5, compiler.vocab_size))


def vocabulary_bytes_of(compiler: GrammarCompiler) -> list[bytes]:
    return [compiler.lltokenizer.decode_bytes([i]) for i in range(compiler.vocab_size)]


def test_each_grammar_compiles_once_even_when_asked_concurrently(compiler: GrammarCompiler) -> None:
    spec = StructuredOutput("regex", "[0-9]{3}-cached")
    results = []
    threads = [threading.Thread(target=lambda: results.append(compiler.compile(spec))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(r) for r in results}) == 1 and compiler.cached(spec)
    assert compiler.compile(StructuredOutput("regex", "[0-9]{3}-cached")) is results[0]


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        (StructuredOutput("json_schema", "{"), "not valid JSON"),
        (StructuredOutput("json_schema", "[1]"), "must be a JSON object"),
        (StructuredOutput("json_schema", '{"type": "string", "format": "no-such-format"}'), "no-such-format"),
        (StructuredOutput("regex", "(a"), "unclosed group"),
        (StructuredOutput("lark", "start: missing_rule"), "missing_rule"),
        (StructuredOutput("ebnf", "root ::= ("), "ebnf"),
        (StructuredOutput("choice", "[]"), "non-empty JSON array"),
        (StructuredOutput("choice", '["a", 1]'), "non-empty JSON array"),
        (StructuredOutput("structural_tag", '{"structures": []}'), "triggers"),
        (StructuredOutput("regex", "a" * (MAX_SOURCE_BYTES + 1)), "larger than"),
    ],
    ids=[
        "bad-json",
        "not-object",
        "unsupported-format",
        "bad-regex",
        "bad-lark",
        "bad-ebnf",
        "empty-choice",
        "non-string-choice",
        "bad-structural-tag",
        "too-large",
    ],
)
def test_bad_constraints_raise_invalid_request_naming_the_problem(
    compiler: GrammarCompiler, spec: StructuredOutput, fragment: str
) -> None:
    with pytest.raises(InvalidRequestError) as error:
        compiler.compile(spec)
    assert fragment in str(error.value) and spec.kind in str(error.value)
    with pytest.raises(InvalidRequestError):  # the failure is cached: the same error again, no recompile
        compiler.compile(spec)


def test_grammar_over_the_time_bound_is_refused(
    compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(grammar, "MAX_COMPILE_SECONDS", 1e-6)  # the real bound: 2 s of build + first mask
    with pytest.raises(InvalidRequestError) as error:
        compiler.compile(StructuredOutput("regex", "(a{100}){300}"))
    assert "too complex" in str(error.value) and "regex" in str(error.value)


def test_choice_and_structural_tag_compile(compiler: GrammarCompiler) -> None:
    assert allowed_ids(compiler, StructuredOutput("choice", '["yes", "no"]'))
    tag = {"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f"]}
    assert compiler.compile(StructuredOutput("structural_tag", json.dumps(tag))).grammar
