"""What the engine returns: per-step deltas, the full outputs assembled from them, stop-string matching.

The engine emits `RequestDelta`s: per step, only what is new for each request that changed (its new
tokens, their logprobs, the text that became visible). `OutputAssembler` folds a request's deltas into
the full `RequestOutput` the offline API returns; folding is concatenation, so the assembled output
holds exactly the tokens, logprob bits and text the deltas carried.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TopLogprobs = list[tuple[int, float]]  # the k best (token id, logprob) of one position


@dataclass
class CompletionOutput:
    """One choice of a request, as generated so far (final once `finish_reason` is set)."""

    index: int  # choice index in [0, n)
    token_ids: list[int]  # generated token ids
    logprobs: list[float]  # logprob of each chosen token (log_softmax of the raw fp32 logits)
    top_logprobs: list[TopLogprobs]  # per step: the k best (token id, logprob); k = params.logprobs
    text: str  # detokenized text; stop strings cut per the request; held back while a stop may be forming
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that finished it


@dataclass
class RequestOutput:
    """All choices of one request, plus prompt-side data."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[float | None] | None = None  # per prompt position (None for position 0)
    prompt_top_logprobs: list[TopLogprobs] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (choice 0)
    speculation: SpeculationCounts | None = None  # None when the engine runs without speculation
    finished: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # set when the request failed inside the engine (its message)


@dataclass(frozen=True)
class SpeculationCounts:
    """A request's speculative decoding so far, summed over its choices: the same counts as the
    engine's `vllm:spec_decode_num_draft_tokens` / `..._num_accepted_tokens` metrics. They say how
    fast the tokens came, never which: the tokens are plain decoding's whatever was drafted."""

    num_draft_tokens: int = 0  # draft tokens the target verified
    num_accepted_tokens: int = 0  # of those, the ones equal to the token chosen at their position

    @property
    def num_rejected_tokens(self) -> int:
        """Draft tokens verified and not kept."""
        return self.num_draft_tokens - self.num_accepted_tokens


@dataclass
class CompletionDelta:
    """What one choice gained in one step (or several merged steps)."""

    index: int  # choice index
    token_ids: list[int]  # new tokens
    logprobs: list[float]  # their logprobs
    top_logprobs: list[TopLogprobs]  # their alternatives (empty when the request asked for none)
    text: str  # text that became visible (never cut again later)
    finish_reason: str | None = None  # set in the choice's last delta
    stop_reason: int | str | None = None


@dataclass
class PromptData:
    """Prompt-side data, carried once by the first delta of a request."""

    token_ids: list[int]
    num_choices: int
    logprobs: list[float | None] | None = None  # when prompt logprobs were asked for
    top_logprobs: list[TopLogprobs] | None = None


@dataclass
class RequestDelta:
    """What one request gained in one engine step; the last one has `finished`."""

    request_id: str
    outputs: list[CompletionDelta]  # choices that changed, in choice order
    num_cached_tokens: int  # prompt tokens of choice 0 served from the prefix cache (latest value)
    finished: bool  # every choice finished, or the request failed
    prompt: PromptData | None = None  # only in the request's first delta
    error: str | None = None  # the request failed inside the engine: this message, no token follows
    speculation: SpeculationCounts | None = None  # latest totals; None when speculation is off


def join_pieces(earlier: CompletionDelta, piece: CompletionDelta) -> CompletionDelta:
    """One piece equal to `earlier` followed by `piece` (same choice): lists and text concatenated."""
    return CompletionDelta(
        index=piece.index,
        token_ids=earlier.token_ids + piece.token_ids,
        logprobs=earlier.logprobs + piece.logprobs,
        top_logprobs=earlier.top_logprobs + piece.top_logprobs,
        text=earlier.text + piece.text,
        finish_reason=piece.finish_reason or earlier.finish_reason,
        stop_reason=piece.stop_reason if piece.finish_reason else earlier.stop_reason,
    )


def merge_deltas(first: RequestDelta, second: RequestDelta) -> RequestDelta:
    """One delta equal to `first` followed by `second` (same request): per choice, lists and text are
    concatenated, so a consumer that merges queued deltas sees the same tokens, bits and text."""
    choices = {c.index: c for c in first.outputs}
    for piece in second.outputs:
        earlier = choices.get(piece.index)
        if earlier is None:
            choices[piece.index] = piece
            continue
        choices[piece.index] = join_pieces(earlier, piece)
    return RequestDelta(
        request_id=first.request_id,
        outputs=[choices[index] for index in sorted(choices)],
        num_cached_tokens=second.num_cached_tokens,
        finished=second.finished,
        prompt=first.prompt or second.prompt,
        error=first.error or second.error,
        speculation=second.speculation,
    )


class OutputAssembler:
    """Folds one request's deltas into its full `RequestOutput` (starts from its first delta)."""

    def __init__(self, first: RequestDelta) -> None:
        if first.prompt is None:
            raise ValueError(f"delta of {first.request_id!r}: the first delta must carry the prompt data")
        self.request_id = first.request_id
        self.prompt = first.prompt
        self.choices = [CompletionOutput(i, [], [], [], "") for i in range(first.prompt.num_choices)]
        self.num_cached_tokens = 0
        self.speculation: SpeculationCounts | None = None
        self.finished = False
        self.error: str | None = None
        self.add(first)

    def add(self, delta: RequestDelta) -> None:
        """Append one delta (in emission order)."""
        for piece in delta.outputs:
            choice = self.choices[piece.index]
            choice.token_ids.extend(piece.token_ids)
            choice.logprobs.extend(piece.logprobs)
            choice.top_logprobs.extend(piece.top_logprobs)
            choice.text += piece.text
            if piece.finish_reason is not None:
                choice.finish_reason = piece.finish_reason
                choice.stop_reason = piece.stop_reason
        self.num_cached_tokens = delta.num_cached_tokens
        self.speculation = delta.speculation
        self.finished = self.finished or delta.finished
        self.error = self.error or delta.error

    @property
    def num_generated(self) -> int:
        """Tokens generated over all choices so far."""
        return sum(len(choice.token_ids) for choice in self.choices)

    def output(self) -> RequestOutput:
        """A snapshot: the request as the deltas so far describe it (lists copied)."""
        prompt = self.prompt
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(prompt.token_ids),
            outputs=[
                CompletionOutput(
                    index=c.index,
                    token_ids=list(c.token_ids),
                    logprobs=list(c.logprobs),
                    top_logprobs=[list(step) for step in c.top_logprobs],
                    text=c.text,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for c in self.choices
            ],
            prompt_logprobs=list(prompt.logprobs) if prompt.logprobs is not None else None,
            prompt_top_logprobs=[list(t) for t in prompt.top_logprobs]
            if prompt.top_logprobs is not None
            else None,
            num_cached_tokens=self.num_cached_tokens,
            speculation=self.speculation,
            finished=self.finished,
            error=self.error,
        )


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
