"""Sampler: greedy ties, seeded Gumbel-max sampling, row/batch/thread invariance (bitwise), filter and
penalty semantics on hand-made logits, raw logprobs, and a negative control with torch.multinomial."""

from __future__ import annotations

import random

import pytest
import torch

from deterministic_inference.engine import sampler, sampling_noise
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.ops.portable import cumsum_rows, log_softmax_rows, softmax_rows


def bits(values: list[float]) -> list[int]:
    return torch.tensor(values, dtype=torch.float32).view(torch.int32).tolist()


def one(
    logits: list[float],
    params: SamplingParams,
    seed: int = 0,
    position: int = 0,
    past: list[int] | None = None,
    output: list[int] | None = None,
) -> int:
    result = sampler.sample(
        torch.tensor([logits]), [params], [seed], [position], [past or []], [output or []]
    )
    return result.token_ids[0]


def draws(logits: list[float], params: SamplingParams, count: int = 300) -> list[int]:
    return [one(logits, params, seed=s) for s in range(count)]


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.5, 1.0, 1.3]),
        top_k=rng.choice([0, 1, 5, 50]),
        top_p=rng.choice([1.0, 0.9, 0.5]),
        min_p=rng.choice([0.0, 0.05]),
        repetition_penalty=rng.choice([1.0, 1.2]),
        presence_penalty=rng.choice([0.0, 0.5]),
        frequency_penalty=rng.choice([0.0, -0.3]),
        logprobs=rng.choice([None, 0, 5]),
    )


def random_batch(
    rng: random.Random, rows: int, vocab: int
) -> tuple[torch.Tensor, list, list, list, list, list]:
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    logits = (
        torch.randn(rows, vocab, generator=gen)
        * torch.tensor([rng.choice([0.5, 3.0, 8.0]) for _ in range(rows)])[:, None]
    )
    params = [random_params(rng) for _ in range(rows)]
    seeds = [rng.randrange(2**63) for _ in range(rows)]
    positions = [rng.randrange(100) for _ in range(rows)]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randrange(6))] for _ in range(rows)]
    pasts = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 10))] + out for out in outputs]
    return logits, params, seeds, positions, pasts, outputs


def result_bits(result: sampler.SampleResult, row: int) -> tuple:
    top = result.top_logprobs[row]
    return result.token_ids[row], bits([result.logprobs[row]]), [t for t, _ in top], bits([v for _, v in top])


def test_greedy_is_argmax_with_ties_to_lowest_id_and_ignores_seed() -> None:
    greedy = SamplingParams(temperature=0.0)
    assert one([1.0, 3.0, 3.0, 2.0], greedy) == 1
    assert {one([0.0, 0.0, 0.0], greedy, seed=s) for s in range(20)} == {0}
    assert one([float("-inf"), -5.0, float("-inf")], greedy) == 1


def test_seeded_sampling_is_reproducible_and_seed_and_position_matter() -> None:
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0)) * 0.5
    params = SamplingParams(seed=1)
    row = logits[0].tolist()
    assert [one(row, params, seed=7, position=p) for p in range(5)] == [
        one(row, params, seed=7, position=p) for p in range(5)
    ]
    assert len({one(row, params, seed=s) for s in range(50)}) > 30
    assert len({one(row, params, seed=7, position=p) for p in range(50)}) > 30


def test_each_row_is_bitwise_the_same_alone_and_in_a_batch_of_32() -> None:
    rng = random.Random(0)
    logits, params, seeds, positions, pasts, outputs = random_batch(rng, 32, 777)
    batch = sampler.sample(logits, params, seeds, positions, pasts, outputs)
    for row in range(32):
        alone = sampler.sample(
            logits[row : row + 1].clone(),
            [params[row]],
            [seeds[row]],
            [positions[row]],
            [pasts[row]],
            [outputs[row]],
        )
        assert result_bits(alone, 0) == result_bits(batch, row)
    # Same row in another batch composition and at another position in the batch.
    order = list(reversed(range(32)))
    shuffled = sampler.sample(
        logits[order],
        [params[i] for i in order],
        [seeds[i] for i in order],
        [positions[i] for i in order],
        [pasts[i] for i in order],
        [outputs[i] for i in order],
    )
    assert [result_bits(shuffled, i) for i in range(32)] == [result_bits(batch, i) for i in order]


def test_thread_count_does_not_change_bits() -> None:
    rng = random.Random(1)
    logits, params, seeds, positions, pasts, outputs = random_batch(rng, 6, 70_000)  # rows above grain size
    params = [
        SamplingParams(top_p=0.95, logprobs=3),
        SamplingParams(),
        SamplingParams(min_p=0.01),
        SamplingParams(top_k=100, top_p=0.8),
        SamplingParams(temperature=0.7),
        SamplingParams(top_p=0.5),
    ]
    before = torch.get_num_threads()
    sampled_bits = []  # per thread count: result_bits of the 6 rows
    noise_bits: list[torch.Tensor] = []  # per thread count: [2, 70_000] int32
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            r = sampler.sample(logits, params, seeds, positions, pasts, outputs)
            sampled_bits.append([result_bits(r, i) for i in range(6)])
            noise = sampling_noise.gumbel_noise(torch.tensor(seeds[:2]), torch.tensor(positions[:2]), 70_000)
            noise_bits.append(noise.view(torch.int32))
    finally:
        torch.set_num_threads(before)
    assert sampled_bits[0] == sampled_bits[1]
    assert torch.equal(noise_bits[0], noise_bits[1])


def test_distribution_matches_softmax() -> None:
    logits = [0.0, 1.0, 2.0, -1.0]
    counts = [0] * 4
    n = 2000
    for token in draws(logits, SamplingParams(), n):
        counts[token] += 1
    probs = torch.softmax(torch.tensor(logits), 0).tolist()
    assert all(abs(c / n - p) < 0.04 for c, p in zip(counts, probs, strict=True))
    cold = draws(logits, SamplingParams(temperature=0.25), 200)
    assert cold.count(2) > 0.9 * 200


def test_top_k_keeps_the_k_best_with_ties_by_id() -> None:
    assert set(draws([1.0, 5.0, 5.0, 3.0], SamplingParams(top_k=2))) == {1, 2}
    assert set(draws([5.0, 1.0, 5.0, 5.0], SamplingParams(top_k=1))) == {0}
    assert set(draws([5.0, 1.0, 5.0, 5.0], SamplingParams(top_k=2))) == {0, 2}
    ids, _ = sampler._filter(torch.tensor([2.0, 9.0, 2.0, 2.0, 1.0]), SamplingParams(top_k=3))
    assert ids.tolist() == [1, 0, 2]


def test_top_p_keeps_the_shortest_prefix_reaching_the_mass() -> None:
    logits = torch.tensor([0.5, 0.3, 0.2]).log().tolist()
    assert set(draws(logits, SamplingParams(top_p=0.4))) == {0}
    assert set(draws(logits, SamplingParams(top_p=0.6))) == {0, 1}
    assert set(draws(logits, SamplingParams(top_p=1.0))) == {0, 1, 2}
    tied = torch.tensor([0.25, 0.25, 0.25, 0.25]).log()
    ids, _ = sampler._filter(tied, SamplingParams(top_p=0.3))
    assert ids.tolist() == [0, 1]  # the equal-probability tie is broken by token id
    ids, _ = sampler._filter(torch.tensor([1.0, 3.0, 2.0, 0.0]), SamplingParams(top_k=3, top_p=0.01))
    assert ids.tolist() == [1]  # the top token always survives


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99, 0.999999])
def test_top_p_without_a_full_sort_equals_the_sorted_prefix(top_p: float) -> None:
    """The growing top-k search keeps exactly the prefix a full stable sort gives (same ids and value
    bits), with probabilities from one softmax of the whole row, summed in sorted order. Rows are wide
    enough (flat and peaked, with ties) that the search must grow past its first 256 tokens."""
    generator = torch.Generator().manual_seed(5)
    for scale in (0.1, 1.0, 8.0):
        row = (torch.randn(49152, generator=generator) * scale).round(decimals=2)  # ties included
        ids, values = sampler._filter(row, SamplingParams(top_p=top_p))
        order = torch.sort(row, descending=True, stable=True).indices
        cumulative = cumsum_rows(softmax_rows(row)[order])
        keep = torch.ones_like(cumulative, dtype=torch.bool)
        keep[1:] = cumulative[:-1] < top_p
        assert ids.tolist() == order[keep].tolist()
        assert torch.equal(values.view(torch.int32), row[order[keep]].view(torch.int32))


def test_min_p_keeps_tokens_above_a_fraction_of_the_best() -> None:
    logits = torch.tensor([0.5, 0.3, 0.2]).log().tolist()
    assert set(draws(logits, SamplingParams(min_p=0.5))) == {0, 1}
    assert set(draws(logits, SamplingParams(min_p=0.7))) == {0}
    ids, _ = sampler._filter(torch.tensor(logits), SamplingParams(min_p=0.39))
    assert ids.tolist() == [0, 1, 2]


def test_penalties() -> None:
    raw = torch.tensor([2.0, -2.0, 1.0, 0.5])
    rep = sampler._apply_penalties(raw, SamplingParams(repetition_penalty=2.0), past=[0, 1, 1], output=[])
    assert rep.tolist() == [1.0, -4.0, 1.0, 0.5]
    freq = sampler._apply_penalties(
        raw, SamplingParams(frequency_penalty=0.5, presence_penalty=1.0), past=[3, 2, 2, 0], output=[2, 2, 0]
    )
    assert freq.tolist() == [2.0 - 0.5 - 1.0, -2.0, 1.0 - 1.0 - 1.0, 0.5]  # prompt token 3 is not penalized
    assert raw.tolist() == [2.0, -2.0, 1.0, 0.5]  # the input is not modified
    greedy = SamplingParams(temperature=0.0, repetition_penalty=4.0)
    assert one([2.0, 1.0, 0.0], greedy, past=[0]) == 1


def test_logprobs_are_raw_and_match_prompt_logprobs_bitwise() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 500, generator=gen) * 4
    params = [
        SamplingParams(temperature=0.3, repetition_penalty=1.5, logprobs=5, top_k=3),
        SamplingParams(logprobs=0),
        SamplingParams(temperature=0.0, logprobs=20),
        SamplingParams(),
    ]
    result = sampler.sample(logits, params, [1, 2, 3, 4], [0, 1, 2, 3], [[0, 1]] * 4, [[1]] * 4)
    values, tops = sampler.prompt_logprobs(logits, result.token_ids, 5)
    assert bits(values) == bits(result.logprobs)
    raw = log_softmax_rows(logits)
    assert result.logprobs == [raw[i, t].item() for i, t in enumerate(result.token_ids)]
    assert [len(t) for t in result.top_logprobs] == [5, 0, 20, 0]
    assert result.top_logprobs[0] == tops[0]
    ids = [t for t, _ in result.top_logprobs[2]]
    assert ids == torch.sort(raw[2], descending=True, stable=True).indices[:20].tolist()
    tied = sampler.prompt_logprobs(torch.zeros(1, 6), [4], 3)
    assert [t for t, _ in tied[1][0]] == [0, 1, 2]


def test_choice_seeds_of_n_equal_single_requests() -> None:
    row = torch.randn(1, 400, generator=torch.Generator().manual_seed(9)).tolist()[0]
    multi = SamplingParams(n=4, seed=11)
    choices = [one(row, multi, seed=multi.choice_seed(0, i)) for i in range(4)]
    singles = [
        one(row, SamplingParams(seed=multi.choice_seed(0, i)), seed=multi.choice_seed(0, i)) for i in range(4)
    ]
    assert choices == singles
    assert len(set(choices)) > 1


def test_negative_control_multinomial_with_a_shared_generator_depends_on_the_batch() -> None:
    """The test setup can detect batch dependence: torch.multinomial with one generator gives a row a
    different token when the rows before it change, while our sampler does not."""
    probs = torch.softmax(torch.randn(8, 1000, generator=torch.Generator().manual_seed(0)), dim=1)
    target = probs[3:4]
    alone = torch.multinomial(target, 1, generator=torch.Generator().manual_seed(0)).item()
    in_batches = [
        torch.multinomial(torch.cat([probs[:k], target]), 1, generator=torch.Generator().manual_seed(0))[
            -1
        ].item()
        for k in range(1, 8)
    ]
    assert any(token != alone for token in in_batches)
    ours_alone = sampler.sample(target.log(), [SamplingParams()], [0], [0], [[]], [[]]).token_ids[0]
    ours = [
        sampler.sample(
            torch.cat([probs[:k], target]).log(),
            [SamplingParams()] * (k + 1),
            [5] * k + [0],
            [0] * (k + 1),
            [[]] * (k + 1),
            [[]] * (k + 1),
        ).token_ids[-1]
        for k in range(1, 8)
    ]
    assert ours == [ours_alone] * 7


def test_batch_length_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="seeds"):
        sampler.sample(torch.zeros(2, 3), [SamplingParams()] * 2, [0], [0, 0], [[], []], [[], []])
