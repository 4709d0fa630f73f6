"""What the engine returns: per-choice completions grouped by request, plus stop-string matching."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One choice of a request, as generated so far (final once `finish_reason` is set)."""

    index: int  # choice index in [0, n)
    token_ids: list[int]  # generated token ids
    logprobs: list[float]  # logprob of each chosen token (log_softmax of the raw fp32 logits)
    top_logprobs: list[
        list[tuple[int, float]]
    ]  # per step: the k best (token id, logprob); k = params.logprobs
    text: str  # detokenized text; stop strings cut per the request; held back while a stop may be forming
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that finished it


@dataclass
class RequestOutput:
    """All choices of one request, plus prompt-side data."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[float | None] | None = None  # per prompt position (None for position 0)
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (choice 0)
    finished: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


def find_stop(text: str, stops: tuple[str, ...], search_from: int) -> tuple[int, str] | None:
    """Earliest (index, stop string) of any stop string in `text` starting at or after `search_from`
    minus the stop's length (so a stop straddling the previous end is found). Ties: the longer stop."""
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, max(0, search_from - len(stop) + 1))
        if index < 0:
            continue
        if best is None or index < best[0] or (index == best[0] and len(stop) > len(best[1])):
            best = (index, stop)
    return best


def held_back_length(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of `text` that could be the start of a stop string (not yet shown)."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest
