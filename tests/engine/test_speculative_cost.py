"""The cost-aware draft length (engine/speculative.py): which steps draft how many tokens, as a function
of the step's batch size and the sequence's acceptance record only (no clock), and, in the engine, wide
batches of text that does not repeat drafting only rare one-token probes while the bits stay plain
decoding's.
"""

from __future__ import annotations

import random

import pytest

from deterministic_inference.engine import speculative
from deterministic_inference.engine.kv_cache import KVCacheManager
from deterministic_inference.engine.request import Request
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.engine.scheduler import Scheduler
from deterministic_inference.engine.speculative import (
    PROBE_MIN_MATCH,
    ROWS_PER_WEIGHT_PASS,
    DraftLength,
    NgramIndex,
    SpeculativeConfig,
    _continuation,
    _latest_start_by_scan,
    affordable_length,
    break_even_rate,
)
from deterministic_inference.model.loader import LoadedModel
from tests.engine.test_speculative import copy_heavy_prompts, run, tiny_loaded  # noqa: F401 - fixture

K3 = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3)


def drive(length: DraftLength, batch: int, steps: int, accept_all: bool) -> list[int]:
    """The draft lengths a sequence asks for over `steps` decode steps at a fixed batch size, when every
    draft is accepted whole (`accept_all`) or every draft is rejected at its first token."""
    asked = []
    for _ in range(steps):
        count = length.next(batch)
        asked.append(count)
        if count:
            length.update(count, count if accept_all else 0)
    return asked


def test_break_even_rises_with_the_batch() -> None:
    """A drafted row is almost free for one stream and costs nearly a token's share at 32 rows."""
    assert break_even_rate(1) == 1 / (ROWS_PER_WEIGHT_PASS + 1)
    assert break_even_rate(32) == 32 / (ROWS_PER_WEIGHT_PASS + 32)
    assert [affordable_length(0.5, batch, 4) for batch in (1, 4, 16, 32)] == [4, 2, 1, 0]
    assert [affordable_length(0.95, batch, 4) for batch in (1, 32)] == [4, 4]
    assert affordable_length(0.2, 1, 4) == 1 and affordable_length(0.05, 1, 4) == 0


def test_free_text_in_a_wide_batch_probes_twice() -> None:
    """Every draft rejected: at 32 rows a fresh sequence (uniform prior 1/2, below the 2/3 break-even)
    drafts two one-token probes and then pauses for PAUSE * 32 (C + 1) / (C + 32) steps; alone it starts
    at K and probes again after 16, 32, ... steps (the rule of a single stream is unchanged)."""
    wide = drive(DraftLength(limit=3), batch=32, steps=160, accept_all=False)
    pause = int(DraftLength.PAUSE * 32 * (ROWS_PER_WEIGHT_PASS + 1) / (ROWS_PER_WEIGHT_PASS + 32))
    assert pause > 160
    assert wide == [1, 1] + [0] * 158
    alone = drive(DraftLength(limit=3), batch=1, steps=160, accept_all=False)
    assert alone[:3] == [3, 1, 0]
    assert alone[2 : 2 + DraftLength.PAUSE] == [0] * DraftLength.PAUSE
    assert sum(alone) > sum(wide)


def test_copying_in_a_wide_batch_ramps_up_to_k() -> None:
    """Every draft accepted: at 32 rows the sequence probes one token at a time until its record beats
    the break-even, then drafts more as the rate rises, up to K; the same sequence of lengths on every
    run (a pure function of the calls)."""
    first = drive(DraftLength(limit=3), batch=32, steps=24, accept_all=True)
    again = drive(DraftLength(limit=3), batch=32, steps=24, accept_all=True)
    assert first == again
    assert first[0] == 1 and first[-1] == 3
    assert first == sorted(first), "the length only grows while everything is accepted"
    assert drive(DraftLength(limit=3), batch=1, steps=3, accept_all=True) == [3, 3, 3]


def test_the_record_follows_the_text() -> None:
    """A copying sequence that turns to free text falls back below break-even at 32 rows and pauses."""
    length = DraftLength(limit=3)
    drive(length, batch=32, steps=30, accept_all=True)
    assert length.next(32) == 3
    length.update(3, 0)
    asked = drive(length, batch=32, steps=40, accept_all=False)
    assert 0 < sum(asked) < 8 and asked[-20:] == [0] * 20


def drafted_per_sequence(loaded: LoadedModel, prompts: list[list[int]], params: SamplingParams) -> list[int]:
    """Draft tokens each sequence scored over its run, after checking the bits are plain decoding's."""
    reference, _ = run(loaded, prompts, params, None)
    got, engine = run(loaded, prompts, params, K3)
    assert got == reference
    drafted: dict[str, int] = {}
    for plan in engine.trace:
        for chunk in plan.chunks:
            drafted[chunk.request_id] = drafted.get(chunk.request_id, 0) + chunk.num_draft_tokens
    return list(drafted.values())


def test_wide_free_text_batch_drafts_only_probes(
    tiny_loaded: LoadedModel,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """32 sequences of random (non-repeating) prompts at T=1: each drafts at most two tokens in its whole
    run (the probes at 32 rows) and the bits are plain decoding's. Negative control: with rows priced as
    free (the cost ignored, the rule of a single stream at any batch size), the same batch drafts more."""
    rng = random.Random(21)
    vocab = tiny_loaded.spec.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(20)] for _ in range(32)]
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True, logprobs=1)
    costed = drafted_per_sequence(tiny_loaded, prompts, params)
    assert len(costed) == 32 and max(costed) <= 2
    monkeypatch.setattr(speculative, "ROWS_PER_WEIGHT_PASS", 10**9)
    free = drafted_per_sequence(tiny_loaded, prompts, params)
    assert sum(free) > 2 * sum(costed), "the rule ignoring the batch size drafts as little: cannot fail"


def test_wide_copy_batch_still_drafts_and_accepts(tiny_loaded: LoadedModel) -> None:  # noqa: F811
    """16 copy-heavy greedy sequences together: the record of the copying ones beats the 16-row
    break-even, so they draft several tokens per step and accept them; bits are plain decoding's."""
    prompts = copy_heavy_prompts(tiny_loaded.spec.vocab_size, 16, seed=4)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    reference, _ = run(tiny_loaded, prompts, params, None)
    got, engine = run(tiny_loaded, prompts, params, K3)
    assert got == reference
    stats = engine.stats()["spec_decode"]
    assert stats["num_accepted_tokens"] > 0.5 * stats["num_draft_tokens"] > 0
    widest = max(c.num_draft_tokens for plan in engine.trace for c in plan.chunks)
    assert widest >= 2


def first_decode_drafts(prompts: list[list[int]]) -> list[int]:
    """Draft tokens per sequence in the first decode step of a batch of `prompts` (a real scheduler and
    KV manager; each prompt's tokens but its last are marked computed, as after its prefill)."""
    kv = KVCacheManager(num_blocks=512, block_size=4, enable_prefix_caching=False, hash_extra="test")
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4)
    scheduler = Scheduler(kv, 64, 4096, 1024, speculative=config)
    requests = []
    for index, prompt in enumerate(prompts):
        request = Request(f"r{index}", prompt, SamplingParams(max_tokens=16), seed=0)
        scheduler.add(request)
        requests.append(request)
    scheduler.schedule()  # admits every sequence and allocates its prompt's blocks
    for request in requests:
        request.num_computed_tokens = request.num_tokens - 1
    plan = scheduler.schedule()
    return [chunk.num_draft_tokens for chunk in plan.chunks]


def test_probes_draft_only_from_a_long_match() -> None:
    """Below break-even (32 fresh sequences) a probe drafts only where the suffix's last 3 tokens recur:
    none of 32 sequences whose suffix recurs as a 2-gram only, one token each where it recurs as a
    3-gram; alone, the 2-gram match drafts K tokens as before."""
    two_gram = [[100 + i, 5, 6, 7, 8, 9, 10, 5, 6] for i in range(32)]
    three_gram = [[100 + i, 5, 6, 7, 8, 9, 10, 5, 6, 7] for i in range(32)]
    assert first_decode_drafts(two_gram) == [0] * 32
    assert first_decode_drafts(three_gram) == [1] * 32
    assert first_decode_drafts(two_gram[:1]) == [3]


def propose_ngram(tokens: list[int], max_draft: int, lookup_min: int, lookup_max: int) -> list[int]:
    """The reference proposer: the plain scan of every window for each n, longest first (what NgramIndex
    must answer on every call)."""
    if max_draft < 1 or len(tokens) < lookup_min + 1:
        return []
    for n in range(min(lookup_max, len(tokens) - 1), lookup_min - 1, -1):
        start = _latest_start_by_scan(tokens, n)
        if start is not None:
            return _continuation(tokens, start + n, max_draft)
    return []


class _FirstStartIndex(NgramIndex):
    """Negative control: keeps each gram's FIRST start (propose_ngram takes the most recent)."""

    @staticmethod
    def _record(latest: dict[int, int], keys: list[int], first: int) -> None:
        for offset, key in enumerate(keys):
            latest.setdefault(key, first + offset)


def _index_disagreements(index_type: type[NgramIndex]) -> tuple[int, set[bool]]:
    """Sequences from a 1-token or a 100-token prompt (indexed with numpy at once) grown token by token
    (small vocabularies, so grams recur), then shrunk, for several lookup ranges and the probe's raised
    minimum: (calls where index_type's propose differs from propose_ngram, whether empty and non-empty
    answers both occurred)."""
    rng = random.Random(7)
    differ, answers = 0, set()
    for vocab in (2, 3, 5, 50):
        for lookup_min, lookup_max in ((1, 1), (1, 3), (2, 4), (3, 5)):
            for prompt in (1, 100):
                index, tokens = (
                    index_type(lookup_min, lookup_max),
                    [rng.randrange(vocab) for _ in range(prompt)],
                )
                for step in range(100):
                    tokens.append(rng.randrange(vocab))
                    if step == 70:
                        tokens = tokens[:30]  # shorter: indexed anew
                    for minimum in {lookup_min, max(lookup_min, min(PROBE_MIN_MATCH, lookup_max))}:
                        expected = propose_ngram(tokens, 3, minimum, lookup_max)
                        differ += index.propose(tokens, 3, minimum) != expected
                        answers.add(bool(expected))
    return differ, answers


def test_ngram_index_proposes_exactly_what_the_scan_proposes(monkeypatch: pytest.MonkeyPatch) -> None:
    """NgramIndex (the scheduler's incremental lookup) gives propose_ngram's drafts on every call, also
    when many grams share a key (multiplier 0: a gram's key is its first token, so the scan fallback
    runs); the control keeping each gram's first start instead of its latest is caught, so the check
    can fail."""
    assert _index_disagreements(NgramIndex) == (0, {True, False})
    assert _index_disagreements(_FirstStartIndex)[0] > 0
    monkeypatch.setattr(speculative, "_GRAM_MULTIPLIER", 0)
    assert _index_disagreements(NgramIndex) == (0, {True, False})
