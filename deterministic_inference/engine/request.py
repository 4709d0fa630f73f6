"""A user request (`ParentRequest`) and the sequences the engine generates for it (`Request`).

A request with n choices is one `ParentRequest` holding n `Request`s (sequences), each with its own seed
(`SamplingParams.choice_seed`). A sequence carries its parent and its choice index, so nothing parses
them back out of ids. The scheduler owns a sequence's `arrival`, `status`, `num_computed_tokens`,
`num_cached_tokens` and `block_ids`, and appends its output tokens in `Scheduler.update`.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.engine.sequence_state import SequenceState
from deterministic_inference.errors import InvalidRequestError

if TYPE_CHECKING:
    from deterministic_inference.engine.grammar_state import SequenceGrammar


class RequestStatus(enum.IntEnum):
    """Life cycle of a sequence; ordered so that every finished status is greater than PREEMPTED."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # something raised for this sequence alone (its detokenization, its sampling)

    @property
    def is_finished(self) -> bool:
        """True for the finished statuses."""
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI `finish_reason` ("stop", "length", "abort", "error"), None while not finished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class ParentRequest:
    """One user request: its id, prompt and params, its sequences in choice order, and the prompt-side
    results shared by them (prompt logprobs are a function of the prompt alone, so whichever sequence
    computes a prompt position first provides it: the bits are the same for every sibling)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.sequences: list[Request] = []  # index = choice index
        self.prompt_logprobs: list[float | None] = []  # per prompt position (None for position 0)
        self.prompt_top_logprobs: list[list[tuple[int, float]]] = []
        self.prompt_sent = False  # the prompt-side data went out in a delta
        self.error: str | None = None  # request-scoped failure message, once one sequence failed

    @property
    def is_finished(self) -> bool:
        """True once every sequence finished (stopped, length, aborted or failed)."""
        return all(sequence.is_finished for sequence in self.sequences)


class Request:
    """One sequence: its prompt and params, and the generation state the scheduler advances.

    Without an explicit `parent`, the sequence is the only choice of a request with its own id."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        parent: ParentRequest | None = None,
        choice_index: int = 0,
        text: SequenceState | None = None,
        grammar: SequenceGrammar | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("prompt: must contain at least one token", param="prompt")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in prompt_token_ids):
            raise InvalidRequestError("prompt: token ids must be non-negative integers", param="prompt")
        self.request_id = request_id  # the sequence id (unique in the engine)
        self.parent = parent if parent is not None else ParentRequest(request_id, prompt_token_ids, params)
        self.choice_index = choice_index
        self.parent.sequences.append(self)
        self.text = text  # detokenized text and stop strings; None = token-level stops only
        self.grammar = grammar  # structured output: this sequence's own matcher; None = unconstrained
        self.arrival = -1  # assigned by Scheduler.add: 0, 1, 2, ... (ties everywhere break by it)
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.seed = seed  # this sequence's sampling seed (already derived for n > 1)
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0  # tokens whose KV is in the cache (prompt first, then outputs)
        self.block_ids: list[int] = []  # KV block table, owned by KVCacheManager
        self.num_cached_tokens = 0  # prefix-cache hit length at the last (re)admission
        self.stop_reason: int | str | None = None  # stop token id or stop string that ended it
        self.num_preemptions = 0
        self.num_draft_tokens = 0  # speculation: draft tokens verified for this sequence so far
        self.num_accepted_tokens = 0  # of those, the ones equal to the token chosen at their position
        # Chained block hashes of this sequence's full blocks (prompt and outputs), filled lazily by
        # KVCacheManager. Tokens never change once known, so they stay valid across preemption.
        self.block_hashes: list[bytes] = []

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the generated tokens."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens known so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def reset_for_recompute(self) -> None:
        """Preempted: KV is gone (blocks already freed), so every known token, outputs included, is
        recomputed like a prompt. Outputs are kept; nothing is sampled again until all known tokens are
        computed."""
        self.block_ids = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, arrival={self.arrival}, status={self.status.name}, "
            f"prompt={self.num_prompt_tokens}, output={len(self.output_token_ids)}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_ids})"
        )
