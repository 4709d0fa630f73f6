"""Admission checks: whether a prompt (token ids) and its sampling params can run on this engine.

One home for these checks: the engine applies them in `add_request`, and the server applies the same
ones on the event loop BEFORE a request reaches the engine thread, so request content never fails inside
an engine step. Every failure is an `InvalidRequestError` naming the field and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.errors import InvalidRequestError

# Sampling divides fp32 logits by the temperature and scales them by the repetition penalty: values
# outside these ranges overflow fp32 (inf, then NaN: 0 / 0, inf - inf) instead of meaning anything.
MIN_TEMPERATURE = 1e-6  # besides 0 (greedy)
REPETITION_PENALTY_RANGE = (0.01, 100.0)


def check_numeric_ranges(params: SamplingParams) -> None:
    """Sampling values whose arithmetic stays finite in fp32 (see MIN_TEMPERATURE)."""
    if 0 < params.temperature < MIN_TEMPERATURE:
        raise InvalidRequestError(
            f"temperature: {params.temperature} is too small to compute with; use 0 for greedy or at least "
            f"{MIN_TEMPERATURE}",
            param="temperature",
        )
    low, high = REPETITION_PENALTY_RANGE
    if not low <= params.repetition_penalty <= high:
        raise InvalidRequestError(
            f"repetition_penalty: {params.repetition_penalty} must be in [{low}, {high}] (1 = off)",
            param="repetition_penalty",
        )


def check_fits(
    num_prompt_tokens: int,
    max_tokens: int,
    max_model_len: int,
    block_size: int,
    num_blocks: int,
    prompt_param: str = "prompt",
    max_tokens_param: str = "max_tokens",
    window_blocks: int = 0,
) -> None:
    """The prompt leaves room to generate within max_model_len, and a sequence running alone always fits
    the KV pool (so preemption can never loop forever). The last generated token's KV is never written,
    hence the - 1. `window_blocks` > 0: the most blocks a sequence holds at once when the pool releases
    those behind an all-layer sliding window (`KVCacheManager.window_block_limit`), a cap on its need."""
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequestError(
            f"{prompt_param}: {num_prompt_tokens} tokens leave no room to generate within the context of "
            f"{max_model_len} tokens; shorten the prompt",
            param=prompt_param,
        )
    longest = min(num_prompt_tokens + max_tokens - 1, max_model_len)
    needed = -(-longest // block_size)
    if window_blocks > 0:
        needed = min(needed, window_blocks)
    if needed > num_blocks:
        raise InvalidRequestError(
            f"{max_tokens_param}: prompt + max_tokens ({longest} tokens of KV) exceed the KV pool "
            f"({num_blocks} blocks of {block_size}); lower max_tokens or shorten the prompt, or raise "
            "num_kv_blocks",
            param=max_tokens_param,
        )


@dataclass(frozen=True)
class AdmissionLimits:
    """The engine's limits on one request (published to the server with the engine's info)."""

    vocab_size: int  # prompt token ids must be in [0, vocab_size)
    max_model_len: int  # prompt + generated tokens
    kv_block_size: int
    num_kv_blocks: int
    window_blocks: int = 0  # most blocks one sequence holds under window freeing (0: no such cap)

    def check(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        prompt_param: str = "prompt",
        max_tokens_param: str = "max_tokens",
    ) -> list[int]:
        """The prompt's ids as a list, after checking them and the context they need."""
        check_numeric_ranges(params)
        ids = list(prompt_token_ids)
        if not ids:
            raise InvalidRequestError(
                f"{prompt_param}: is empty; give at least one token", param=prompt_param
            )
        vocab = self.vocab_size
        for token in ids:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
                raise InvalidRequestError(
                    f"{prompt_param}: token id {token!r} is outside [0, {vocab})", param=prompt_param
                )
        if len(ids) < self.max_model_len and len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"{max_tokens_param}: prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds the context of {self.max_model_len} tokens; shorten the prompt or lower "
                "max_tokens",
                param=max_tokens_param,
            )
        check_fits(
            len(ids),
            params.max_tokens,
            self.max_model_len,
            self.kv_block_size,
            self.num_kv_blocks,
            prompt_param,
            max_tokens_param,
            self.window_blocks,
        )
        return ids
