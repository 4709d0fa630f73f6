"""One sequence the engine generates: prompt, sampling params, seed, status, outputs and KV block table.

The engine expands a request with n > 1 into n `Request`s with ids "<id>-<i>", each with its own seed
(`SamplingParams.choice_seed`). The scheduler owns `arrival`, `status`, `num_computed_tokens`,
`num_cached_tokens` and `block_ids`; the engine appends logprobs and sets `stop_reason`.
"""

from __future__ import annotations

import enum

from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.errors import InvalidRequestError


class RequestStatus(enum.IntEnum):
    """Life cycle of a sequence; ordered so that every finished status is greater than PREEMPTED."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        """True for the three finished statuses."""
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI `finish_reason` ("stop", "length", "abort"), None while not finished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence: its prompt and params, and the generation state the scheduler and engine advance."""

    def __init__(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int
    ) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("prompt: must contain at least one token", param="prompt")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in prompt_token_ids):
            raise InvalidRequestError("prompt: token ids must be non-negative integers", param="prompt")
        self.request_id = request_id
        self.arrival = -1  # assigned by Scheduler.add: 0, 1, 2, ... (ties everywhere break by it)
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.seed = seed  # this sequence's sampling seed (already derived for n > 1)
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[float] = []  # logprob of each chosen token (raw model logits)
        self.output_top_logprobs: list[list[tuple[int, float]]] = []  # per step, when params.logprobs
        self.num_computed_tokens = 0  # tokens whose KV is in the cache (prompt first, then outputs)
        self.block_ids: list[int] = []  # KV block table, owned by KVCacheManager
        self.num_cached_tokens = 0  # prefix-cache hit length at the last (re)admission
        self.stop_reason: int | str | None = None  # stop token id or stop string that ended it
        self.num_preemptions = 0
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
        recomputed like a prompt. Outputs and logprobs are kept; nothing is sampled again until all
        known tokens are computed."""
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
