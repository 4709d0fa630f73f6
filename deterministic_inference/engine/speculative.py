"""Speculative decoding settings (`--speculative-config`, vLLM's names) and the n-gram proposer.

Speculation changes speed, never a sample: the target model scores a sequence's last token and its
drafted tokens in one pass, every position's token is chosen exactly as plain decoding would choose it
(`engine/spec_verify.py`), and a draft token is kept only when it equals that choice. So the settings
here are not numerics: they do not enter the fingerprint.

Proposer (method "ngram", prompt lookup): the longest suffix of the sequence's known tokens (prompt +
output) of n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`, that also occurs earlier
in them; the draft is the tokens that followed its MOST RECENT earlier occurrence (documented choice:
recent text is the likeliest to be copied next), at most K of them; when that occurrence is so recent
that fewer than K tokens follow it, the copy goes on with the same period (a repetition continues). A
pure function of the tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from deterministic_inference.errors import ConfigError

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # drafts per step: more only costs rows when acceptance ends early
DEFAULT_DISABLE_BY_BATCH_SIZE: int | None = None  # see SpeculativeConfig.disable_by_batch_size
_FIELDS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "model",
    "disable_by_batch_size",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """What to draft with and how many tokens per step (vLLM's `speculative_config` field names)."""

    method: str = "ngram"  # "ngram" (prompt lookup) or "draft_model"
    num_speculative_tokens: int = 4  # K: most drafted tokens scored per sequence and step
    prompt_lookup_min: int = 1  # shortest suffix n-gram looked up (ngram)
    prompt_lookup_max: int = 4  # longest suffix n-gram looked up (ngram)
    model: str | None = None  # draft model path (draft_model)
    # no drafting in a step that starts with more running sequences than this (None: draft at any
    # batch size): a batch that large is no longer bound by memory, so verified drafts cost compute
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        field = "speculative_config"
        if self.method not in METHODS:
            raise ConfigError(f"{field}.method: {self.method!r} is not one of {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"{field}.num_speculative_tokens: {k!r} must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]"
            )
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ConfigError(f"{field}.{name}: {value!r} must be a positive integer")
        size = self.disable_by_batch_size
        if size is not None and (not _is_int(size) or size < 1):
            raise ConfigError(f"{field}.disable_by_batch_size: {size!r} must be a positive integer or null")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"{field}.prompt_lookup_min: {self.prompt_lookup_min} is above prompt_lookup_max "
                f"{self.prompt_lookup_max}; lower it"
            )
        if self.method == "draft_model" and not self.model:
            raise ConfigError(f"{field}.model: missing; give the draft model's GGUF file or HF directory")
        if self.method == "ngram" and self.model is not None:
            raise ConfigError(f"{field}.model: only method 'draft_model' takes a model; remove it")

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> SpeculativeConfig:
        """Parse `--speculative-config` (a JSON object, or an already parsed dict); ConfigError naming
        the field on any problem."""
        if isinstance(text, str):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as error:
                raise ConfigError(
                    f"speculative_config: not valid JSON ({error.msg}); write e.g. "
                    '\'{"method": "ngram", "num_speculative_tokens": 4}\''
                ) from None
        else:
            value = text
        if not isinstance(value, dict):
            raise ConfigError("speculative_config: must be a JSON object")
        unknown = sorted(set(value) - set(_FIELDS))
        if unknown:
            raise ConfigError(
                f"speculative_config.{unknown[0]}: unknown field; known fields: {', '.join(_FIELDS)}"
            )
        if "method" not in value:
            raise ConfigError("speculative_config.method: missing; give 'ngram'")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (for the manifest and the server's info)."""
        # disable_by_batch_size is kept when None: it then means "draft at any batch size"
        return {
            name: getattr(self, name)
            for name in _FIELDS
            if getattr(self, name) is not None or name == "disable_by_batch_size"
        }

    def drafts_at(self, num_running: int) -> bool:
        """True when a step that starts with `num_running` running sequences may draft."""
        return self.disable_by_batch_size is None or num_running <= self.disable_by_batch_size


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_GRAM_MASK = (1 << 64) - 1
_GRAM_MULTIPLIER = 0x9E3779B97F4A7C15  # odd: keys are sum_j token_j * M^j mod 2^64


def _gram_keys(tokens: np.ndarray, n: int, count: int) -> np.ndarray:
    """The key of the n-gram starting at each of tokens[:count] ([count] uint64, wrapping arithmetic)."""
    keys = np.zeros(count, dtype=np.uint64)
    power = np.uint64(1)
    with np.errstate(over="ignore"):
        for j in range(n):
            keys += tokens[j : j + count].astype(np.uint64) * power
            power = np.uint64((int(power) * _GRAM_MULTIPLIER) & _GRAM_MASK)
    return keys


def _gram_key(gram: list[int]) -> int:
    """_gram_keys' key of one gram, in Python ints."""
    key, power = 0, 1
    for token in gram:
        key = (key + token * power) & _GRAM_MASK
        power = (power * _GRAM_MULTIPLIER) & _GRAM_MASK
    return key


class NgramIndex:
    """One sequence's n-grams (n in [lookup_min, lookup_max]) by key, each key mapped to the latest start
    of a gram with that key, indexed as the sequence grows. `propose` drafts what the module docstring
    defines, in a few dictionary lookups instead of a scan of every window (~1.5 ms per step at 6k tokens
    of context; tests compare it with that scan). A 6k-token prompt is indexed in a few ms (numpy), once.

    Exact: the match for size n is the largest start i <= len - 1 - n whose window equals the suffix.
    Those windows are indexed in ascending order, so a later start overwrites. No entry for the suffix's
    key: no window equals it. An entry whose window equals the suffix: the latest such window (a later
    equal one would have overwritten it). An entry whose window differs (two grams with one key): that
    size falls back to the scan. Decides work, never a sample."""

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self._sizes = range(lookup_min, lookup_max + 1)
        self._latest: dict[int, dict[int, int]] = {n: {} for n in self._sizes}
        self._count = 0  # the token count the index is complete for

    def propose(self, tokens: list[int], max_draft: int, lookup_min: int) -> list[int]:
        """Up to `max_draft` tokens that followed the most recent earlier occurrence of the longest suffix
        n-gram of `tokens` (n in [lookup_min, the index's lookup_max]; lookup_min within the index's
        range); [] when none occurs or max_draft < 1."""
        count = len(tokens)
        if max_draft < 1 or count < lookup_min + 1:
            return []
        self._extend(tokens)
        for n in range(min(self._sizes[-1], count - 1), lookup_min - 1, -1):
            suffix = tokens[count - n :]
            start = self._latest[n].get(_gram_key(suffix))
            if start is None:
                continue
            if tokens[start : start + n] != suffix:  # another gram with the suffix's key
                start = _latest_start_by_scan(tokens, n)
                if start is None:
                    continue
            return _continuation(tokens, start + n, max_draft)
        return []

    def _extend(self, tokens: list[int]) -> None:
        """Index the grams of `tokens` that end at index <= len - 2 (anew if the tokens shrank)."""
        count = len(tokens)
        if count < self._count:
            for latest in self._latest.values():
                latest.clear()
            self._count = 0
        array = np.asarray(tokens, dtype=np.int64) if count - self._count > 64 else None  # a prompt
        for n, latest in self._latest.items():
            first = max(0, self._count - n)
            if count - n <= first:
                continue
            if array is not None:  # vectorised keys
                keys = _gram_keys(array[first:], n, count - n - first).tolist()
            else:
                keys = [_gram_key(tokens[start : start + n]) for start in range(first, count - n)]
            self._record(latest, keys, first)
        self._count = count

    @staticmethod
    def _record(latest: dict[int, int], keys: list[int], first: int) -> None:
        """keys[i] is the key of the gram starting at first + i: in ascending order, the latest wins."""
        latest.update(zip(keys, range(first, first + len(keys)), strict=True))


def _latest_start_by_scan(tokens: list[int], n: int) -> int | None:
    """The largest start i <= len - 1 - n whose window equals the last n tokens: windows[i] = tokens[i :
    i + n] for every start whose window ends before the suffix starts or overlaps it, never the suffix
    itself (i < len - n)."""
    array = np.asarray(tokens, dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(array[: len(tokens) - 1], n)  # [len - n, n]
    matches = np.flatnonzero((windows == array[len(tokens) - n :]).all(axis=1))
    return int(matches[-1]) if matches.size else None


def _continuation(tokens: list[int], start: int, count: int) -> list[int]:
    """`count` tokens copied from `start` on; past the end the copy reads its own earlier drafts (a
    match that overlaps the suffix continues the repetition period)."""
    extended = list(tokens[start:])
    period = len(tokens) - start
    for j in range(len(extended), count):
        extended.append(extended[j - period])
    return extended[:count]


@dataclass
class SpecDecodeStats:
    """Cumulative speculation counters (plain ints) for /metrics."""

    num_drafts: int = 0  # drafted steps verified (one per sequence and step with drafts)
    num_draft_tokens: int = 0  # draft tokens scored
    num_accepted_tokens: int = 0  # draft tokens equal to the token chosen at their position
    num_emitted_tokens: int = 0  # tokens appended by drafted steps (accepted + the one chosen after)
    # acceptance_lengths[a] = drafted steps that accepted exactly a draft tokens (a in [0, K])
    acceptance_lengths: list[int] | None = None
    accepted_per_position: list[int] | None = None  # [j] = drafted steps that accepted draft j

    def snapshot(self) -> dict[str, Any]:
        """The counters as a fresh dict (lists copied: the engine thread keeps counting)."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_emitted_tokens": self.num_emitted_tokens,
            "acceptance_lengths": list(self.acceptance_lengths or []),
            "accepted_per_position": list(self.accepted_per_position or []),
        }

    def record(self, drafted: int, accepted: int, emitted: int, max_tokens: int) -> None:
        """Count one verified drafted step."""
        if self.acceptance_lengths is None or self.accepted_per_position is None:
            self.acceptance_lengths = [0] * (max_tokens + 1)
            self.accepted_per_position = [0] * max_tokens
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.num_emitted_tokens += emitted
        self.acceptance_lengths[accepted] += 1
        for position in range(accepted):
            self.accepted_per_position[position] += 1


# A step of R rows takes about (ROWS_PER_WEIGHT_PASS + R) times the cost of one more row: the fixed part
# (one pass over the weights, the step's Python) counted in rows. Measured on the 2-core test machine
# with the default model (bench/RESULTS.md, issue 35 third session: ~12.5 ms per step + ~0.7 ms per
# row at 1 thread, so ~18; 16 is the rounder, slightly more cautious value).
ROWS_PER_WEIGHT_PASS = 16


# The shortest suffix match an ngram probe drafts from (capped by prompt_lookup_max): below break-even a
# sequence tests whether its text has started to copy, and a 1- or 2-token match says little about that
# (in free text most tokens recur somewhere), while 3 tokens that recur are a quote in progress.
PROBE_MIN_MATCH = 3


def break_even_rate(batch: int) -> float:
    """The chance of acceptance a draft token needs to pay for its verification row in a step of
    `batch` decoding rows: the row adds 1 / (ROWS_PER_WEIGHT_PASS + batch) of the step's time, and the
    step yields `batch` tokens, so an expected gain of p tokens pays iff p >= batch / (C + batch).
    0.06 for a single stream (rows are almost free: the pass is bound by memory), 0.67 at 32 rows."""
    return batch / (ROWS_PER_WEIGHT_PASS + batch)


def affordable_length(rate: float, batch: int, limit: int) -> int:
    """The most draft tokens (<= limit) that each pay for their row: draft j (from 1) is accepted only
    if drafts 1..j-1 were, so with a per-position acceptance `rate` its chance is rate**j, and j is
    drafted while rate**j >= break_even_rate(batch). A pure function of its arguments."""
    threshold = break_even_rate(batch)
    length, chance = 0, rate
    while length < limit and chance >= threshold:
        length += 1
        chance *= rate
    return length


@dataclass
class DraftLength:
    """One sequence's adaptive, cost-aware draft length.

    Acceptance record: decayed counts of draft positions tested and accepted (a draft of d tokens that
    kept a tests a + 1 positions if a < d, else d), giving the per-position acceptance rate
    (accepted + 1) / (tested + 2). Each step drafts at most `affordable_length(rate, batch)` tokens, so
    drafts are made only where they pay for their rows at the step's batch size (at 32 rows a rejected
    draft costs as much as a token; at 1 row it is almost free).

    Adaptive length, as before: grows by one after a fully accepted draft, falls to (accepted + 1) after
    a partial one, and to 0 after two drafts in a row with nothing accepted; at 0 it waits `PAUSE` decode
    steps, then tries one token again. Below break-even (affordable length 0, `probing`) the sequence
    drafts only such one-token probes (ngram: from a match of PROBE_MIN_MATCH tokens), and two rejected
    in a row pause it for `PAUSE * scale(batch)` steps instead, scale(batch) = batch (C + 1) / (C +
    batch): 1 for a single stream, ~11 at 32 rows, so probes cost about the same share of a step's time
    at any batch size (two, not one: a quote that starts mid-word often misses its first draft and then
    copies). Pauses double with each pause in a row (up to 8x) until a
    draft is accepted again. Only speed depends on all this: the tokens are plain decoding's whatever is
    drafted; the decisions themselves are a pure function of the calls made (no clock)."""

    PAUSE = 16
    DECAY = 0.95  # weight of the older record at each update: the rate follows the recent text

    limit: int  # K
    current: int = -1  # -1 = not started (K)
    misses: int = 0  # consecutive drafts with nothing accepted
    paused: int = 0  # decode steps left without drafting
    pauses: int = 0  # pauses since a draft was last accepted
    tested: float = 0.0  # decayed count of draft positions verified
    accepted: float = 0.0  # decayed count of those accepted
    batch: int = 1  # decoding rows of the step last drafted for

    @property
    def rate(self) -> float:
        """Estimated chance that a draft position is accepted (uniform prior: 1/2 with no record)."""
        return (self.accepted + 1.0) / (self.tested + 2.0)

    def probing(self, batch: int) -> bool:
        """True when no draft token pays for its row at this batch size: a draft now is a probe."""
        return affordable_length(self.rate, batch, self.limit) == 0

    def next(self, batch: int = 1) -> int:
        """Tokens to draft this step (0 = none), in a step with `batch` running sequences."""
        if self.current < 0:
            self.current = self.limit
        if self.current == 0:
            if self.paused > 0:
                self.paused -= 1
                return 0
            self.current = 1
        self.batch = batch
        return min(self.current, max(1, affordable_length(self.rate, batch, self.limit)))

    def update(self, drafted: int, accepted: int) -> None:
        """Adapt after a verified draft of `drafted` tokens that kept `accepted`."""
        probe = self.probing(self.batch)
        self.tested = self.DECAY * self.tested + accepted + (1 if accepted < drafted else 0)
        self.accepted = self.DECAY * self.accepted + accepted
        if accepted > 0:
            self.misses = self.pauses = 0
            self.current = min(self.limit, drafted + 1) if accepted == drafted else accepted + 1
            return
        self.misses += 1
        self.current = 0 if self.misses >= 2 else 1
        if self.current == 0:
            pause = self._probe_pause() if probe else self.PAUSE
            self.paused, self.misses = pause << min(self.pauses, 3), 0
            self.pauses += 1

    def _probe_pause(self) -> int:
        scale = self.batch * (ROWS_PER_WEIGHT_PASS + 1) / (ROWS_PER_WEIGHT_PASS + self.batch)
        return int(self.PAUSE * scale)
