"""The scheduler -> model-runner contract: one `StepPlan` per engine step.

The plan is the ONLY thing the runner sees of the scheduler's state, and it is what the engine trace
records, so it is a frozen value with plain fields. It is built deterministically: chunks are ordered by
request arrival number, never by dict or set iteration order or the wall clock.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduledChunk:
    """The tokens one request feeds through the model in this step."""

    request_id: str  # internal sequence id (a request with n > 1 has one sequence per choice)
    token_ids: tuple[int, ...]  # tokens to compute now: a prompt chunk, or the last sampled token
    start_position: int  # position of token_ids[0]; equals the tokens already in the KV cache
    block_ids: tuple[int, ...]  # the sequence's KV blocks, covering start_position + len(token_ids) tokens
    # (an entry of -1, kv_cache.FREED_BLOCK: released behind an all-layer sliding window, never read)
    sample: bool  # True when the chunk reaches the end of the known tokens: sample from its last row
    all_logits: bool  # True when every row's logits are needed (prompt logprobs), else only the last row
    num_cached_tokens: int = 0  # prompt tokens this sequence took from the prefix cache (for the trace)
    # speculation: the last num_draft_tokens of token_ids are drafted (unverified) tokens; with `sample`,
    # the logits of the last num_draft_tokens + 1 rows are computed and verified (engine/spec_verify.py)
    num_draft_tokens: int = 0


@dataclass(frozen=True)
class StepPlan:
    """Everything the model runner needs for one step, and what the engine trace records of it."""

    step_id: int  # logical clock: 0, 1, 2, ... per engine
    chunks: tuple[ScheduledChunk, ...]  # ordered by arrival number of their requests
    preempted_ids: tuple[str, ...] = ()  # sequences preempted (KV freed, to be recomputed) in this step

    @property
    def num_batched_tokens(self) -> int:
        """Total rows the model computes in this step."""
        return sum(len(chunk.token_ids) for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        """True when nothing is scheduled (no request is waiting or running)."""
        return not self.chunks
