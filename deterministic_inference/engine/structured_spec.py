"""What a constrained request asks for: the grammar's kind and its source text.

`StructuredOutput` is the one contract between the APIs that accept constraints (OpenAI `response_format`
and `tools`, vLLM `structured_outputs` / `guided_*`, SGLang `sampling_params`, `detinf generate`, manifests)
and the engine, which compiles it with the grammar engine and masks the request's logits with it. It is
frozen and hashable so it can sit in `SamplingParams`; its digest (with the vocabulary's) keys the compiled
grammar cache, so equal constraints compile once.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal, get_args

from deterministic_inference.errors import InvalidRequestError

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "ebnf", "lark", "structural_tag"]
GRAMMAR_KINDS: tuple[str, ...] = get_args(GrammarKind)
_DIGEST_DOMAIN = b"detinf-structured-output-v1\x00"


@dataclass(frozen=True)
class StructuredOutput:
    """A request's output constraint.

    kind: which grammar language `source` is written in.
    source: the constraint's text, by kind —
      json_schema: the JSON schema as JSON text (callers canonicalize it: sorted keys, no spaces);
      json_object: "" (any JSON object);
      regex: the pattern (the whole output must match it);
      choice: a JSON array of strings (the output is exactly one of them);
      ebnf: a GBNF grammar (llama.cpp's / vLLM's EBNF dialect, root rule `root`);
      lark: a grammar in the grammar engine's Lark dialect (start rule `start`);
      structural_tag: JSON text of a structural-tag spec (free text with constrained tagged regions).
    """

    kind: GrammarKind
    source: str

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidRequestError(
                f"structured output kind {self.kind!r} is not one of {', '.join(GRAMMAR_KINDS)}"
            )
        if not isinstance(self.source, str):
            raise InvalidRequestError(f"structured output {self.kind}: the source must be a string")

    def digest(self) -> str:
        """Stable hex sha256 of (kind, source): the same in every process (never Python `hash()`)."""
        payload = _DIGEST_DOMAIN + self.kind.encode() + b"\x00" + self.source.encode("utf-8")
        return hashlib.sha256(payload).hexdigest()
