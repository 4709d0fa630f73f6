"""JSON encoding, SSE framing and OpenAI logprob structures.

Floats are written with Python's `repr` (what `json.dumps` does): the shortest decimal that parses back
to the same double, and a logprob is a float32 widened exactly to a double, so a client that parses the
JSON and rounds to float32 recovers the engine's bits. Non-finite logprobs (never expected) are written
as -9999.0 like OpenAI does, so the body is always valid JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from starlette.responses import Response

from deterministic_inference.engine.outputs import RequestOutput
from deterministic_inference.model.tokenizer import Tokenizer

NON_FINITE_LOGPROB = -9999.0


def dumps(content: Any) -> str:
    """Compact JSON (UTF-8 text kept as is, repr floats, NaN refused)."""
    return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def json_response(content: Any, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON response encoded with `dumps`."""
    return Response(dumps(content), status_code=status_code, headers=headers, media_type="application/json")


def sse_event(content: Any) -> str:
    """One server-sent event carrying JSON."""
    return f"data: {dumps(content)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def finite(value: float) -> float:
    """The logprob itself, or NON_FINITE_LOGPROB if it is not finite."""
    return value if math.isfinite(value) else NON_FINITE_LOGPROB


def chat_logprobs_content(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    top_logprobs: Sequence[Sequence[tuple[int, float]]],
    num_top: int,
) -> list[dict[str, Any]]:
    """Chat `logprobs.content`: per token its text, logprob, bytes and `num_top` alternatives."""
    entries = []
    for step, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
        tops = top_logprobs[step][:num_top] if step < len(top_logprobs) else []
        entries.append(
            {
                **_token_entry(tokenizer, token_id, logprob),
                "top_logprobs": [_token_entry(tokenizer, alt, value) for alt, value in tops],
            }
        )
    return entries


def _token_entry(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    return {
        "token": tokenizer.token_text(token_id),
        "logprob": finite(logprob),
        "bytes": list(tokenizer.token_bytes(token_id)),
    }


def completion_logprobs(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    logprobs: Sequence[float | None],
    top_logprobs: Sequence[Sequence[tuple[int, float]]] | None,
    text_offset: int,
) -> dict[str, Any]:
    """Legacy completions `logprobs`: tokens, token_logprobs, top_logprobs (dicts), text_offset.

    `logprobs[i]` is None for the first prompt token (echo). Offsets count characters from
    `text_offset` (where these tokens start in the choice's text)."""
    tokens: list[str] = []
    offsets: list[int] = []
    tops: list[dict[str, float] | None] = []
    offset = text_offset
    for step, token_id in enumerate(token_ids):
        text = tokenizer.token_text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += text_length(tokenizer, token_id)
        if top_logprobs is None:
            tops.append(None)
        else:
            alternatives = top_logprobs[step] if step < len(top_logprobs) else []
            tops.append({tokenizer.token_text(alt): finite(value) for alt, value in alternatives} or None)
    values = [None if value is None else finite(value) for value in logprobs]
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def vllm_prompt_logprobs(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    logprobs: Sequence[float | None],
    top_logprobs: Sequence[Sequence[tuple[int, float]]] | None,
    num_top: int,
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` of a completion choice: None for the first prompt token, then per token a
    dict keyed by token id (as a string) holding the prompt token itself and the `num_top` best, each
    ``{"logprob", "rank", "decoded_token"}``. The prompt token's rank is known when it is among the top
    alternatives; otherwise it is null (the engine does not rank the whole vocabulary)."""
    result: list[dict[str, dict[str, Any]] | None] = []
    for position, token_id in enumerate(token_ids):
        value = logprobs[position] if position < len(logprobs) else None
        if position == 0 or value is None:
            result.append(None)
            continue
        known = top_logprobs is not None and position < len(top_logprobs)
        step = list(top_logprobs[position]) if top_logprobs is not None and known else []
        ranks = {alt: rank for rank, (alt, _) in enumerate(step, start=1)}
        entry = {str(token_id): _vllm_logprob(tokenizer, token_id, value, ranks.get(token_id))}
        for rank, (alt, alt_value) in enumerate(step[:num_top], start=1):
            entry.setdefault(str(alt), _vllm_logprob(tokenizer, alt, alt_value, rank))
        result.append(entry)
    return result


def _vllm_logprob(tokenizer: Tokenizer, token_id: int, value: float, rank: int | None) -> dict[str, Any]:
    return {"logprob": finite(value), "rank": rank, "decoded_token": tokenizer.decode([token_id], False)}


def text_length(tokenizer: Tokenizer, token_id: int) -> int:
    """Characters a token adds to decoded text (0 for special tokens like BOS); for `text_offset`. A
    continuation: a SentencePiece token "▁the" adds 4 characters, its space included."""
    return len(tokenizer.decode([token_id], continuation=True))


def merge_completion_logprobs(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Concatenate legacy logprob blocks (prompt part + output part)."""
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key, values in merged.items():
            values.extend(part[key])
    return merged


def usage(outputs: Sequence[RequestOutput]) -> dict[str, Any]:
    """OpenAI `usage` over the outputs of one response (their prompts and choices), with the prompt
    tokens served from the prefix cache (choice 0 of each prompt). When the engine speculates,
    `completion_tokens_details` says how many draft tokens were kept (`accepted_prediction_tokens`)
    and verified but not kept (`rejected_prediction_tokens`): OpenAI's names for predicted outputs,
    the engine's own per-request counts. Without speculation the field is absent."""
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    completion_tokens = sum(len(choice.token_ids) for output in outputs for choice in output.outputs)
    document: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(output.num_cached_tokens for output in outputs)},
    }
    counts = [output.speculation for output in outputs if output.speculation is not None]
    if counts:
        document["completion_tokens_details"] = {
            "accepted_prediction_tokens": sum(c.num_accepted_tokens for c in counts),
            "rejected_prediction_tokens": sum(c.num_rejected_tokens for c in counts),
        }
    return document
