"""The audit modes. Each sends requests whose *content* is fixed by the audit's seed, at concurrency
and in batch company that vary, and returns cases: the samples of one target that must all be equal.

single       one prompt at concurrency 1, 2, 4 .. C (identical requests in flight together)
mixed        the target among random other prompts of random lengths and max_tokens
prefix       prompts sharing prefixes of different lengths with the target (prefix-cache hits at
             different block boundaries), alone, after them and together with them
radix        scoring (echo + prompt logprobs) cold, with a cache hit, and after POST /flush_cache
concurrency  R requests of one prompt at concurrency C
sampling     temperature > 0 with fixed seeds: each seed stable; different seeds must differ
p_vs_d       each target's greedy output: the logprob of every decoded token equals the logprob of the
             same token when prompt + output is scored as one prompt (SGLang's p_vs_d; needs the
             server to return token ids: vLLM's and detinf's `return_token_ids`)
structured   JSON-schema constrained targets (greedy and seeded) alone, then among unconstrained and
             other constrained requests at concurrency: the constrained outputs must not change
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from deterministic_inference.audit.client import AuditClient, Sample
from deterministic_inference.audit.prompts import TARGET_PROMPTS, long_text, random_prompt


@dataclass(frozen=True)
class AuditSettings:
    """What the modes send."""

    n_trials: int = 3  # rounds per case
    concurrency: int = 10  # most requests in flight (single, mixed, concurrency)
    requests: int = 100  # requests of the concurrency mode
    max_tokens: int = 16
    seeds: int = 4  # seeds of the sampling mode
    temperature: float = 0.8  # of the sampling mode
    seed: int = 0  # seed of the audit's own random prompts
    default_max_model_len: int = 2048  # context assumed when the server does not say
    max_prompt_tokens: int = 1024  # longest shared prefix of prefix/radix (also clipped to the context)


@dataclass
class Case:
    """Samples that must all be identical (or, for `expect_unique=False`, must differ)."""

    name: str
    mode: str
    samples: list[Sample] = field(default_factory=list)
    expect_identical: bool = True
    notes: list[str] = field(default_factory=list)

    @property
    def unique(self) -> int:
        """Number of distinct outputs."""
        return len({s.digest for s in self.samples})

    @property
    def passed(self) -> bool:
        """Identical cases: one unique output; 'must differ' cases: more than one."""
        if not self.samples:
            return False
        return self.unique == 1 if self.expect_identical else self.unique > 1


async def gather_limited(calls: Sequence[Callable[[], Awaitable[Sample]]], limit: int) -> list[Sample]:
    """Run the calls with at most `limit` in flight; results in call order."""
    semaphore = asyncio.Semaphore(max(limit, 1))

    async def run(call: Callable[[], Awaitable[Sample]]) -> Sample:
        async with semaphore:
            return await call()

    return list(await asyncio.gather(*(run(call) for call in calls)))


async def run_mode(mode: str, client: AuditClient, settings: AuditSettings) -> list[Case]:
    """The cases of one mode."""
    runners: dict[str, Callable[[AuditClient, AuditSettings], Awaitable[list[Case]]]] = {
        "single": _single,
        "mixed": _mixed,
        "prefix": _prefix,
        "radix": _radix,
        "concurrency": _concurrency,
        "sampling": _sampling,
        "p_vs_d": _p_vs_d,
        "structured": _structured,
    }
    return await runners[mode](client, settings)


def _levels(concurrency: int) -> list[int]:
    levels, level = [], 1
    while level < concurrency:
        levels.append(level)
        level *= 2
    return [*levels, max(concurrency, 1)]


async def _single(client: AuditClient, s: AuditSettings) -> list[Case]:
    case = Case("single: one prompt at concurrency " + ",".join(map(str, _levels(s.concurrency))), "single")
    prompt = TARGET_PROMPTS[0]
    for _ in range(s.n_trials):
        for level in _levels(s.concurrency):
            calls = [partial(client.generate, prompt, s.max_tokens) for _ in range(level)]
            case.samples += await gather_limited(calls, level)
    return [case]


async def _mixed(client: AuditClient, s: AuditSettings) -> list[Case]:
    rng = random.Random(s.seed)
    cases = [Case(f"mixed: target {i} alone and among random prompts", "mixed") for i in range(2)]
    for index, case in enumerate(cases):  # baseline: each target alone
        case.samples.append(await client.generate(TARGET_PROMPTS[index], s.max_tokens))
    for _ in range(s.n_trials):
        calls: list[tuple[int | None, Callable[[], Awaitable[Sample]]]] = []
        for index in range(len(cases)):
            prompt = TARGET_PROMPTS[index]
            calls.append((index, partial(client.generate, prompt, s.max_tokens)))
        for _ in range(rng.randint(1, max(s.concurrency - len(cases), 1))):
            other = random_prompt(rng, rng.randint(2, 60))
            tokens = rng.randint(1, 2 * s.max_tokens)
            calls.append((None, partial(client.generate, other, tokens)))
        rng.shuffle(calls)
        results = await gather_limited([call for _, call in calls], s.concurrency)
        for (target, _), sample in zip(calls, results, strict=True):
            if target is not None:
                cases[target].samples.append(sample)
    return cases


async def _calibrated_text(client: AuditClient, s: AuditSettings) -> str:
    """A long shared text clipped so prompts built on it (plus max_tokens) fit the context."""
    context = client.max_model_len or s.default_max_model_len
    budget = max(min(context - 2 * s.max_tokens - 32, s.max_prompt_tokens), 8)
    text = long_text(s.seed, 4 * budget)
    probe_text = text[:400]
    probe = await client.generate(probe_text, 1)
    ratio = (probe.prompt_token_count or len(probe_text)) / len(probe_text)  # tokens per character
    chars = int(min(len(text), budget * 0.8 / max(ratio, 1e-3)))
    return text[:chars]


async def _prefix(client: AuditClient, s: AuditSettings) -> list[Case]:
    shared = await _calibrated_text(client, s)
    target = shared + " Summarize the text above in one sentence."
    case = Case("prefix: target after/with prompts sharing prefixes of 10..100% of it", "prefix")
    fractions = (0.1, 0.33, 0.5, 0.77, 0.9, 1.0)
    flushed = await client.flush_cache()
    case.samples.append(await client.generate(target, s.max_tokens))  # cold
    for trial in range(s.n_trials):
        for fraction in fractions:
            sibling = shared[: int(len(shared) * fraction)] + f" Variation {trial}: list three facts."
            await client.generate(sibling, s.max_tokens)
            case.samples.append(await client.generate(target, s.max_tokens))  # after a sibling
        siblings = [shared[: int(len(shared) * f)] + f" Together {trial}." for f in fractions]
        calls = [partial(client.generate, p, s.max_tokens) for p in siblings]
        calls.append(partial(client.generate, target, s.max_tokens))
        case.samples.append((await gather_limited(calls, len(calls)))[-1])
    if not flushed:
        case.notes.append("server has no /flush_cache or /reset_prefix_cache: the first sample may not be "
                          "cold")
    return [case]


async def _radix(client: AuditClient, s: AuditSettings) -> list[Case]:
    shared = await _calibrated_text(client, s)
    prompt = shared[: len(shared) // 2] + " The end."
    generation = Case("radix: generation cold vs cache hit vs after flush", "radix")
    cases = [generation]
    if not client.endpoint.chat:  # chat has no echo: scoring needs /completions
        cases.append(Case("radix: scoring (prompt logprobs) cold vs cache hit vs after flush", "radix"))
    for _ in range(s.n_trials):
        flushed = await client.flush_cache()
        for _ in range(2):  # cold (after a flush), then with the prompt cached
            generation.samples.append(await client.generate(prompt, s.max_tokens))
        if len(cases) > 1:
            flushed = await client.flush_cache() and flushed
            cases[1].samples += [await client.score(prompt), await client.score(prompt)]
        if not flushed:
            for case in cases:
                case.notes.append("server has no /flush_cache or /reset_prefix_cache: only cache hits were "
                                  "compared")
            break
    for case in cases:
        hits = sorted({h for h in (x.cached_tokens for x in case.samples) if h})
        case.notes.append(f"cached prompt tokens reported: {hits}" if hits else "no cache hit reported")
    return cases


async def _concurrency(client: AuditClient, s: AuditSettings) -> list[Case]:
    case = Case(f"concurrency: {s.requests} requests at concurrency {s.concurrency}", "concurrency")
    prompt = TARGET_PROMPTS[1]
    calls = [partial(client.generate, prompt, s.max_tokens) for _ in range(s.requests)]
    case.samples = await gather_limited(calls, s.concurrency)
    return [case]


async def _sampling(client: AuditClient, s: AuditSettings) -> list[Case]:
    prompt = TARGET_PROMPTS[2]
    seeds = [1000 + i for i in range(s.seeds)]
    cases = [Case(f"sampling: seed {seed} at temperature {s.temperature}", "sampling") for seed in seeds]
    calls: list[tuple[int, Callable[[], Awaitable[Sample]]]] = []
    for _ in range(s.n_trials):
        for index, seed in enumerate(seeds):
            calls.append((index, partial(client.generate, prompt, s.max_tokens, s.temperature, seed)))
    results = await gather_limited([call for _, call in calls], s.concurrency)
    for (index, _), sample in zip(calls, results, strict=True):
        cases[index].samples.append(sample)
    differ = Case(
        f"sampling: {len(seeds)} different seeds give different outputs", "sampling", expect_identical=False
    )
    differ.samples = [case.samples[0] for case in cases if case.samples]
    return [*cases, differ]


async def _p_vs_d(client: AuditClient, s: AuditSettings) -> list[Case]:
    cases = []
    for index, prompt in enumerate(TARGET_PROMPTS):
        name = f"p_vs_d: target {index}: decoded logprobs == the same tokens scored as a prompt"
        case = Case(name, "p_vs_d")
        cases.append(case)
        if not client.endpoint.logprobs:
            case.notes.append("needs logprobs (run without --no-logprobs)")
            continue
        decoded = await client.generate_ids(prompt, s.max_tokens)
        if decoded is None:
            case.notes.append("the server returned no token ids (return_token_ids): cannot compare")
            continue
        prompt_ids, output_ids, values = decoded
        scored = (await client.score_ids(prompt_ids + output_ids))[len(prompt_ids):]
        case.samples.append(Sample("", None, [list(pair) for pair in zip(output_ids, values, strict=False)]))
        case.samples.append(Sample("", None, [list(pair) for pair in zip(output_ids, scored, strict=False)]))
    return cases


AUDIT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 24},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
    },
    "required": ["topic", "score"],
    "additionalProperties": False,
}


async def _structured(client: AuditClient, s: AuditSettings) -> list[Case]:
    rng = random.Random(s.seed)
    targets = [(TARGET_PROMPTS[0], 0.0, 0), (TARGET_PROMPTS[1], s.temperature, 1234)]
    cases = [Case(f"structured: JSON-schema target {i} (T={t}) alone and in mixed company", "structured")
             for i, (_, t, _) in enumerate(targets)]  # fmt: skip

    def target_call(index: int) -> Callable[[], Awaitable[Sample]]:
        prompt, temperature, seed = targets[index]
        return partial(client.generate, prompt, s.max_tokens, temperature, seed, AUDIT_SCHEMA)

    for index, case in enumerate(cases):  # baseline: each target alone
        case.samples.append(await target_call(index)())
    for _ in range(s.n_trials):
        calls: list[tuple[int | None, Callable[[], Awaitable[Sample]]]] = [
            (index, target_call(index)) for index in range(len(cases))
        ]
        for k in range(rng.randint(2, max(s.concurrency - len(cases), 2))):
            other = random_prompt(rng, rng.randint(2, 60))
            schema = AUDIT_SCHEMA if k % 2 else None  # constrained and unconstrained neighbours
            calls.append(
                (None, partial(client.generate, other, rng.randint(1, 2 * s.max_tokens), 0.7, k, schema))
            )
        rng.shuffle(calls)
        results = await gather_limited([call for _, call in calls], s.concurrency)
        for (target, _), sample in zip(calls, results, strict=True):
            if target is not None:
                cases[target].samples.append(sample)
    return cases


def describe(case: Case) -> dict[str, Any]:
    """JSON-ready summary of a case (distinct outputs with counts, most frequent first)."""
    counts: dict[str, list[Any]] = {}
    for sample in case.samples:
        entry = counts.setdefault(sample.digest, [0, sample])
        entry[0] += 1
    distinct = sorted(counts.items(), key=lambda item: (-item[1][0], item[0]))
    return {
        "name": case.name,
        "mode": case.mode,
        "expect_identical": case.expect_identical,
        "total_samples": len(case.samples),
        "unique_samples": case.unique,
        "passed": case.passed,
        "notes": case.notes,
        "system_fingerprints": sorted({s.system_fingerprint or "" for s in case.samples}),
        "distinct_outputs": [
            {"sha256": digest, "count": count, "text": sample.text, "finish_reason": sample.finish_reason}
            for digest, (count, sample) in distinct
        ],
    }
