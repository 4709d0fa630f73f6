"""Speculative decoding (ngram) gives the bits of plain decoding: tokens, logprob and top-logprob bits,
greedy and seeded, alone and in mixed batches with chunked prefill, preemption and prefix-cache hits.

Each comparison is bitwise and each speculative run must actually accept drafts (else it would only
show that plain decoding equals itself). The negative control replaces exact verification by the
standard rejection sampler (accept a draft with probability min(1, p/q), else resample from the
residual) and must be detected as different at T > 0.
"""

from __future__ import annotations

import random
import struct
from typing import Any

import pytest
import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine import spec_verify
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.model_runner import ModelRunnerOutput, SampledToken
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.engine.speculative import DraftLength, NgramIndex, SpeculativeConfig
from deterministic_inference.errors import ConfigError
from deterministic_inference.model.loader import LoadedModel, load_model
from deterministic_inference.ops.logprobs import log_softmax_rows
from tests.tiny_models import TinyModel

# drafting at any batch size (the default stops drafting in large batches): the mixed batches below
# must have drafted and plain rows side by side
NGRAM = SpeculativeConfig(
    method="ngram",
    num_speculative_tokens=4,
    prompt_lookup_min=1,
    prompt_lookup_max=3,
    disable_by_batch_size=None,
)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
# low temperature / few survivors: the tiny random model repeats itself, so drafts are both accepted
# and rejected (the noise decides at some positions)
SEEDED = SamplingParams(max_tokens=24, temperature=0.1, seed=1234, ignore_eos=True, logprobs=3)
SEEDED_TOP_P = SamplingParams(
    max_tokens=24, temperature=0.5, top_k=3, top_p=0.9, seed=7, ignore_eos=True, logprobs=2
)


def bits(value: float) -> int:
    return int(struct.unpack("<I", struct.pack("<f", value))[0])


def signature(output: Any) -> list[tuple[Any, ...]]:
    """Per choice: token ids, logprob bits, top-logprob bits, text and finish reason."""
    return [
        (
            tuple(c.token_ids),
            tuple(bits(v) for v in c.logprobs),
            tuple(tuple((t, bits(v)) for t, v in step) for step in c.top_logprobs),
            c.text,
            c.finish_reason,
        )
        for c in output.outputs
    ]


@pytest.fixture(scope="module")
def tiny_loaded(tiny_llama_dir: TinyModel) -> LoadedModel:
    return load_model(str(tiny_llama_dir.path))


def copy_heavy_prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a passage (what prompt lookup drafts from) and random ones."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        passage = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 20))]
        prompts.append(passage * rng.randint(2, 4) if i % 2 == 0 else passage + passage[:3])
    return prompts


def engine_for(loaded: LoadedModel, speculative: SpeculativeConfig | None, **overrides: Any) -> Engine:
    settings: dict[str, Any] = {
        "dtype": "float32",
        "selfcheck": False,
        "enable_prefix_caching": False,
        "speculative_config": speculative,
    }
    settings.update(overrides)
    return Engine(EngineConfig(**settings), loaded=loaded, record_trace=True)


def run(
    loaded: LoadedModel,
    prompts: list[list[int]] | list[str],
    params: SamplingParams | list[SamplingParams],
    speculative: SpeculativeConfig | None,
    **overrides: Any,
) -> tuple[list[list[tuple[Any, ...]]], Engine]:
    engine = engine_for(loaded, speculative, **overrides)
    outputs = engine.generate(prompts, params)
    return [signature(o) for o in outputs], engine


def accepted(engine: Engine) -> int:
    return int(engine.stats()["spec_decode"]["num_accepted_tokens"])


# -- the proposer and the settings -------------------------------------------------------------------


def _propose(tokens: list[int], max_draft: int, lookup_min: int, lookup_max: int) -> list[int]:
    """The scheduler's proposer (a fresh index) on `tokens`."""
    return NgramIndex(lookup_min, lookup_max).propose(tokens, max_draft, lookup_min)


def test_ngram_proposer_continues_the_most_recent_match() -> None:
    assert _propose([1, 2, 3, 9, 1, 2], 3, 1, 3) == [3, 9, 1]
    assert _propose([1, 2, 3, 1, 2, 4, 1, 2], 2, 1, 3) == [4, 1]  # the most recent "1 2"
    assert _propose([5, 5, 5], 4, 1, 2) == [5, 5, 5, 5]  # a repetition goes on with its period
    assert _propose([1, 2, 3, 4], 3, 1, 3) == []  # no earlier occurrence
    assert _propose([1, 2, 1, 2], 0, 1, 3) == []
    assert _propose([1, 2, 9, 2], 2, 2, 3) == []  # a 1-gram would match, but min is 2


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('{"method": "medusa", "num_speculative_tokens": 2}', "speculative_config.method"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "speculative_config.num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 99}', "speculative_config.num_speculative_tokens"),
        ('{"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min"),
        ('{"method": "ngram", "lookahead": 2}', "speculative_config.lookahead"),
        ('{"method": "ngram", "disable_by_batch_size": 0}', "speculative_config.disable_by_batch_size"),
        ('{"method": "ngram", "disable_by_batch_size": 2.5}', "speculative_config.disable_by_batch_size"),
        ('{"num_speculative_tokens": 2}', "speculative_config.method"),
        ("[1, 2]", "speculative_config"),
        ("{method: ngram}", "speculative_config"),
    ],
)
def test_bad_speculative_config_names_the_field(text: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        SpeculativeConfig.from_json(text)


# -- bitwise equality with plain decoding ------------------------------------------------------------


@pytest.mark.parametrize("params", [GREEDY, SEEDED, SEEDED_TOP_P], ids=["greedy", "seeded", "seeded-top-p"])
def test_speculative_alone_equals_plain(tiny_loaded: LoadedModel, params: SamplingParams) -> None:
    prompts = copy_heavy_prompts(tiny_loaded.spec.vocab_size, 3, seed=1)
    plain = [run(tiny_loaded, [p], params, None)[0][0] for p in prompts]
    total = 0
    for k in (2, 8):
        config = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=3)
        for prompt, expected in zip(prompts, plain, strict=True):
            got, engine = run(tiny_loaded, [prompt], params, config)
            assert got[0] == expected, f"K={k} differs"
            total += accepted(engine)
    assert total > 0, "no draft was ever accepted: the verification path was not exercised"


@pytest.fixture(scope="module")
def tiny32_loaded(tiny_llama32_dir: TinyModel) -> LoadedModel:
    """The tiny Llama of head_dim 32, for the q8_0 KV cache."""
    return load_model(str(tiny_llama32_dir.path))


def test_speculative_rollback_on_a_q8_kv_cache_equals_plain(tiny32_loaded: LoadedModel) -> None:
    """Rejected drafts' q8_0 slots are rolled back and rewritten: the bits of plain decoding on q8_0."""
    prompts = copy_heavy_prompts(tiny32_loaded.spec.vocab_size, 4, seed=1)
    total = 0
    for params in (GREEDY, SEEDED):
        for prompt in prompts:
            plain = run(tiny32_loaded, [prompt], params, None, kv_cache_dtype="q8_0")[0][0]
            got, engine = run(tiny32_loaded, [prompt], params, NGRAM, kv_cache_dtype="q8_0")
            assert got[0] == plain
            total += accepted(engine)
    assert total > 0, "no draft was ever accepted: the verification path was not exercised"


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_speculative_in_mixed_batches_equals_plain(tiny_loaded: LoadedModel, params: SamplingParams) -> None:
    """Speculating and plain rows share steps (a plain-decoding neighbour at T=0.7 without drafts in
    the first engine): chunked prefill (budget 7), preemption (a small pool of small blocks)."""
    assert_mixed_batches_equal_plain(
        tiny_loaded, copy_heavy_prompts(tiny_loaded.spec.vocab_size, 10, seed=2), params, NGRAM
    )


def assert_mixed_batches_equal_plain(
    loaded: LoadedModel, prompts: list[list[int]], params: SamplingParams, method: SpeculativeConfig
) -> None:
    """Every third prompt a plain-sampling neighbour (T=0.7); all of them speculating with `method`, alone
    (the reference: no speculation) vs together without chunking, with chunked prefill (budget 7) and
    with preemption (a small pool of small blocks): the same outputs, drafts accepted, blocks returned."""
    other = SamplingParams(max_tokens=20, temperature=0.7, seed=3, ignore_eos=True, logprobs=1)
    params_list = [params if i % 3 else other for i in range(len(prompts))]
    reference = [run(loaded, [p], q, None)[0][0] for p, q in zip(prompts, params_list, strict=True)]
    for overrides in (
        {},
        {"max_num_batched_tokens": 7},
        {"max_num_batched_tokens": 64, "kv_block_size": 4, "num_kv_blocks": 30},
    ):
        got, engine = run(loaded, prompts, params_list, method, **overrides)
        assert got == reference, f"differs with {overrides}"
        assert accepted(engine) > 0
        if "num_kv_blocks" in overrides:
            assert engine.scheduler.num_preemptions > 0, "the small pool must preempt"
        assert engine.kv.num_used_blocks == 0, "every block came back"


def run_with_prefix_hits(
    loaded: LoadedModel, prompts: list[list[int]], params: SamplingParams, speculative: SpeculativeConfig
) -> tuple[list[list[list[tuple[Any, ...]]]], Engine]:
    """The prompts run twice through one engine with the prefix cache on (the second round hits the
    blocks the first registered); per round, the signatures. After every step it checks that no cached
    block holds an unverified token: registered blocks cover computed tokens only, and computed tokens
    are known (verified) tokens."""
    engine = engine_for(loaded, speculative, enable_prefix_caching=True, kv_block_size=4)
    rounds = []
    for _ in range(2):
        ids = [engine.add_request(p, params) for p in prompts]
        while engine.has_unfinished:
            engine.step()
            for sequence in engine.scheduler.sequences.values():
                committed = engine.kv._num_committed.get(sequence.request_id, 0)
                assert committed * engine.kv.block_size <= sequence.num_computed_tokens
                assert sequence.num_computed_tokens <= sequence.num_tokens
        outputs = [engine._assembled[i].output() for i in ids]
        for i in ids:
            engine.release(i)
        rounds.append([signature(o) for o in outputs])
    return rounds, engine


def test_speculative_with_prefix_hits_equals_plain(tiny_loaded: LoadedModel) -> None:
    """A warm prefix cache (the same prompts twice) gives plain bits, and no cached block ever holds an
    unverified token (`run_with_prefix_hits`)."""
    prompts = copy_heavy_prompts(tiny_loaded.spec.vocab_size, 6, seed=4)
    for params in (GREEDY, SEEDED):
        reference = [run(tiny_loaded, [p], params, None)[0][0] for p in prompts]
        rounds, engine = run_with_prefix_hits(tiny_loaded, prompts, params, NGRAM)
        assert rounds == [reference, reference]
        assert engine.kv.stats.hit_tokens > 0 and accepted(engine) > 0


def test_penalties_stops_and_n_equal_plain(tiny_loaded: LoadedModel) -> None:
    """Penalties (depend on the output so far: per drafted position), stop token ids, stop strings,
    max_tokens inside an accepted run, and n > 1."""
    vocab = tiny_loaded.spec.vocab_size
    prompts = copy_heavy_prompts(vocab, 4, seed=5)
    plain_greedy = run(tiny_loaded, prompts[:1], GREEDY, None)[0][0][0]
    stop_token = plain_greedy[0][5]
    text = plain_greedy[3]
    cases = [
        SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3, ignore_eos=True, logprobs=2),
        SamplingParams(
            max_tokens=24,
            temperature=0.1,
            frequency_penalty=0.4,
            presence_penalty=0.2,
            seed=11,
            ignore_eos=True,
        ),
        SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(stop_token,), ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.0, stop=(text[len(text) // 2 :][:3],), ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.1, n=3, seed=21, ignore_eos=True, logprobs=1),
    ]
    for params in cases:
        reference = [run(tiny_loaded, [p], params, None)[0][0] for p in prompts]
        got, engine = run(tiny_loaded, prompts, params, NGRAM)
        assert got == reference, f"differs for {params}"
        assert engine.stats()["spec_decode"]["num_drafts"] > 0


# -- the negative control ---------------------------------------------------------------------------


def rejection_verify(
    chunks: list[spec_verify.DraftedChunk], sample_fn: Any, out: ModelRunnerOutput, masks: Any
) -> None:
    """The standard rejection sampler (temperature only): accept draft d with probability min(1, p(d) /
    q(d)) where the prompt-lookup draft has q(d) = 1; on rejection sample from the residual max(0, p - q)
    (p without d, renormalized); after K accepted drafts sample the bonus token from p. Its uniforms come
    from a generator seeded per (seed, output position), as reproducible as it gets."""
    del sample_fn, masks
    for chunk in chunks:
        sequence = chunk.sequence
        temperature = sequence.params.temperature
        run: list[SampledToken] = []
        for j in range(len(chunk.drafts) + 1):
            raw = chunk.logits[j].to(torch.float32)
            logprobs = log_softmax_rows(raw.reshape(1, -1))[0]
            probs = torch.softmax(raw.double() / temperature, dim=0)
            position = len(sequence.output_token_ids) + j
            generator = torch.Generator().manual_seed(sequence.seed * 100003 + position)
            if j < len(chunk.drafts):
                draft = chunk.drafts[j]
                if float(torch.rand(1, generator=generator, dtype=torch.float64)) < float(probs[draft]):
                    run.append(SampledToken(draft, float(logprobs[draft]), []))
                    continue
                probs[draft] = 0.0
            token = int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
            run.append(SampledToken(token, float(logprobs[token]), []))
            break
        out.sampled[sequence.request_id] = run[0]
        out.accepted[sequence.request_id] = run[1:]
        out.drafted[sequence.request_id] = len(chunk.drafts)


def test_negative_control_rejection_sampler_differs(
    tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same comparison with the usual rejection sampler in place of exact verification finds a
    difference at T > 0: the test above can fail."""
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=1234, ignore_eos=True)
    prompts = copy_heavy_prompts(tiny_loaded.spec.vocab_size, 6, seed=1)
    reference = [run(tiny_loaded, [p], params, None)[0][0] for p in prompts]
    exact = [run(tiny_loaded, [p], params, NGRAM)[0][0] for p in prompts]
    assert exact == reference
    monkeypatch.setattr(spec_verify, "verify_drafts", rejection_verify)
    rejected = [run(tiny_loaded, [p], params, NGRAM)[0][0] for p in prompts]
    differing = [i for i, (a, b) in enumerate(zip(rejected, reference, strict=True)) if a != b]
    assert differing, "the rejection sampler gave plain decoding's tokens: the tests cannot fail"


def test_draft_length_adapts_down_to_zero_and_back() -> None:
    length = DraftLength(limit=4)
    assert length.next() == 4
    length.update(4, 4)
    assert length.next() == 4  # stays at K after a full acceptance
    length.update(4, 1)
    assert length.next() == 2  # accepted + 1
    length.update(2, 0)
    assert length.next() == 1
    length.update(1, 0)  # a second draft in a row with nothing accepted: pause
    assert [length.next() for _ in range(DraftLength.PAUSE)] == [0] * DraftLength.PAUSE
    assert length.next() == 1  # then try one token again
    length.update(1, 0)
    assert length.next() == 1
    length.update(1, 0)  # still nothing: a pause twice as long
    assert [length.next() for _ in range(2 * DraftLength.PAUSE)] == [0] * (2 * DraftLength.PAUSE)
    assert length.next() == 1
    length.update(1, 1)
    assert length.next() == 2


def test_free_text_drafts_little(tiny_loaded: LoadedModel) -> None:
    """On text that does not repeat (T=1), rejected drafts shrink the draft length: most decode steps
    draft nothing, and the output is still plain decoding's."""
    rng = random.Random(8)
    prompts = [[rng.randrange(3, tiny_loaded.spec.vocab_size) for _ in range(40)] for _ in range(3)]
    params = SamplingParams(max_tokens=48, temperature=1.0, seed=2, ignore_eos=True)
    reference = [run(tiny_loaded, [p], params, None)[0][0] for p in prompts]
    got, engine = run(tiny_loaded, prompts, params, NGRAM)
    assert got == reference
    stats = engine.stats()["spec_decode"]
    assert stats["num_draft_tokens"] < 0.5 * 3 * 48 * NGRAM.num_speculative_tokens


def test_engine_config_takes_the_json_or_its_dict() -> None:
    """Ray Serve's app builder passes EngineConfig fields as plain JSON values."""
    expected = SpeculativeConfig(num_speculative_tokens=3)
    text = '{"method": "ngram", "num_speculative_tokens": 3}'
    assert EngineConfig(speculative_config=text).speculative_config == expected  # type: ignore[arg-type]
    as_dict = {"method": "ngram", "num_speculative_tokens": 3}
    assert EngineConfig(speculative_config=as_dict).speculative_config == expected  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="speculative_config"):
        EngineConfig(speculative_config=3)  # type: ignore[arg-type]


def test_per_request_counts_sum_to_the_engine_counts(tiny_loaded: LoadedModel) -> None:
    """Each output's `speculation` (what usage reports) counts its own drafts: over a mixed batch with
    n > 1 and preemption the outputs add up to the engine's counters; without speculation it is None."""
    prompts = copy_heavy_prompts(tiny_loaded.spec.vocab_size, 6, seed=9)
    two_choices = SamplingParams(max_tokens=16, temperature=0.1, n=2, seed=5, ignore_eos=True)
    params = [GREEDY, SEEDED, two_choices] * 2
    engine = engine_for(tiny_loaded, NGRAM, kv_block_size=4, num_kv_blocks=30, max_num_batched_tokens=64)
    outputs = engine.generate(prompts, params)
    counts = [o.speculation for o in outputs]
    assert all(c is not None for c in counts)
    stats = engine.stats()["spec_decode"]
    assert sum(c.num_accepted_tokens for c in counts if c is not None) == stats["num_accepted_tokens"] > 0
    assert sum(c.num_draft_tokens for c in counts if c is not None) == stats["num_draft_tokens"]
    assert engine.scheduler.num_preemptions > 0
    plain = engine_for(tiny_loaded, None).generate(prompts[:1], GREEDY)
    assert plain[0].speculation is None


def test_no_drafts_above_disable_by_batch_size(tiny_loaded: LoadedModel) -> None:
    """With disable_by_batch_size=2, no step with more than 2 sequences drafts (all are admitted in the
    first step, so a step's chunks are the sequences running when it starts), later steps with fewer
    do, and the bits are plain decoding's throughout. Without the limit, steps of 3+ draft."""
    prompts = copy_heavy_prompts(tiny_loaded.spec.vocab_size, 5, seed=14)
    lengths = [8, 12, 16, 40, 48]  # the batch shrinks as the short ones finish
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2) for n in lengths]
    reference = [run(tiny_loaded, [p], q, None)[0][0] for p, q in zip(prompts, params, strict=True)]
    widths = {}
    for limit in (2, None):
        config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, disable_by_batch_size=limit)
        got, engine = run(tiny_loaded, prompts, params, config)
        assert got == reference
        assert accepted(engine) > 0
        widths[limit] = [len(p.chunks) for p in engine.trace if any(c.num_draft_tokens for c in p.chunks)]
    assert widths[2] and max(widths[2]) <= 2
    assert max(widths[None]) > 2, "the unlimited engine must draft in wide steps: else this test cannot fail"
