"""Sampling parameters of one request, validated on creation.

`SamplingParams` is frozen and hashable. Every invalid value raises `InvalidRequestError` naming the field
(`param`) and the accepted range, which the server maps to HTTP 400.

Seeds: a request without a seed uses the engine's default seed, so every request is reproducible. With
n > 1 each choice gets its own seed derived from (seed, choice index) by sha256 (`choice_seed`), so choice i
of an n-choice request equals a single request whose seed is that derived seed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from deterministic_inference.engine.structured_spec import StructuredOutput
from deterministic_inference.errors import InvalidRequestError

MAX_LOGPROBS = 20  # most top-k alternatives returned per position
SEED_LIMIT = 2**63  # seeds are in [0, 2**63) so they fit a signed 64-bit integer
_CHOICE_SEED_DOMAIN = b"detinf-choice-seed-v1"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request (OpenAI / vLLM semantics); validated on creation."""

    n: int = 1  # number of choices
    max_tokens: int = 16  # most tokens generated per choice
    temperature: float = 1.0  # 0 = greedy (argmax, ties -> lowest token id)
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    top_k: int = 0  # keep the k best tokens; 0 or -1 = off
    min_p: float = 0.0  # keep tokens with prob >= min_p * max prob; 0 = off
    seed: int | None = None  # None = the engine's default seed
    repetition_penalty: float = 1.0  # > 0; over prompt + output tokens; 1 = off
    presence_penalty: float = 0.0  # in [-2, 2]; over output tokens
    frequency_penalty: float = 0.0  # in [-2, 2]; over output tokens
    stop: tuple[str, ...] = ()  # stop strings (the engine matches them on the detokenized text)
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that end the choice
    ignore_eos: bool = False  # keep generating past the end-of-sequence token
    logprobs: int | None = None  # top-k alternatives per output step (0..20); None = chosen token only
    prompt_logprobs: int | None = None  # top-k alternatives per prompt position (0..20); None = none
    include_stop_str_in_output: bool = False
    structured_output: StructuredOutput | None = None  # grammar the output must follow; None = free text

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen to tuples so the params stay hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate_counts()
        self._validate_filters()
        self._validate_penalties()
        self._validate_stops()
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise InvalidRequestError(
                "structured_output: must be a StructuredOutput (or None)", param="structured_output"
            )

    @property
    def greedy(self) -> bool:
        """True when tokens are picked by argmax (temperature 0)."""
        return self.temperature == 0.0

    def choice_seed(self, default_seed: int, choice_index: int) -> int:
        """Seed of choice `choice_index`: the request seed (or `default_seed`) when n == 1, else derived.

        For n > 1 the seed is the first 8 bytes (big-endian, top bit cleared) of
        sha256(domain || base seed as 8 bytes || choice index as 8 bytes): a stable integer hash that is
        the same in every process (never Python `hash()`), so choice i of n equals a single request with
        this seed.
        """
        if not 0 <= choice_index < self.n:
            raise InvalidRequestError(f"choice_index: {choice_index} must be in [0, {self.n})", param="n")
        base = self.seed if self.seed is not None else default_seed
        if self.n == 1:
            return base
        return derive_choice_seed(base, choice_index)

    def _validate_counts(self) -> None:
        _int_at_least("n", self.n, 1)
        _int_at_least("max_tokens", self.max_tokens, 1)
        if self.seed is not None:
            _int_field("seed", self.seed)
            if not 0 <= self.seed < SEED_LIMIT:
                raise InvalidRequestError(f"seed: {self.seed} must be in [0, 2**63)", param="seed")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _int_field(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise InvalidRequestError(
                        f"{name}: {value} must be between 0 and {MAX_LOGPROBS}", param=name
                    )

    def _validate_filters(self) -> None:
        _number("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequestError(
                f"temperature: {self.temperature} must be >= 0 (0 = greedy)", param="temperature"
            )
        _number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p: {self.top_p} must be in (0, 1]", param="top_p")
        _int_field("top_k", self.top_k)
        if self.top_k < -1:
            raise InvalidRequestError(
                f"top_k: {self.top_k} must be >= 1, or 0 / -1 to disable", param="top_k"
            )
        _number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p: {self.min_p} must be in [0, 1]", param="min_p")

    def _validate_penalties(self) -> None:
        _number("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0:
            raise InvalidRequestError(
                f"repetition_penalty: {self.repetition_penalty} must be > 0 (1 = off)",
                param="repetition_penalty",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _number(name, value)
            if not -2 <= value <= 2:
                raise InvalidRequestError(f"{name}: {value} must be in [-2, 2]", param=name)

    def _validate_stops(self) -> None:
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise InvalidRequestError(f"stop: {text!r} must be a non-empty string", param="stop")
        for token_id in self.stop_token_ids:
            _int_field("stop_token_ids", token_id)
            if token_id < 0:
                raise InvalidRequestError(
                    f"stop_token_ids: {token_id} must be a non-negative token id", param="stop_token_ids"
                )


def derive_choice_seed(base_seed: int, choice_index: int) -> int:
    """Stable seed of choice `choice_index` of a request with seed `base_seed` (sha256, in [0, 2**63))."""
    payload = _CHOICE_SEED_DOMAIN + base_seed.to_bytes(8, "big") + choice_index.to_bytes(8, "big")
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "big") & (SEED_LIMIT - 1)


def _int_field(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequestError(f"{name}: {value!r} must be an integer", param=name)


def _int_at_least(name: str, value: object, low: int) -> None:
    _int_field(name, value)
    if value < low:  # type: ignore[operator]
        raise InvalidRequestError(f"{name}: {value} must be >= {low}", param=name)


def _number(name: str, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or value != value:
        raise InvalidRequestError(f"{name}: {value!r} must be a finite number", param=name)
    if value in (float("inf"), float("-inf")):
        raise InvalidRequestError(f"{name}: {value!r} must be a finite number", param=name)
