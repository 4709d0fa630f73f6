"""The sampler's batched seeded path (`seeded_batch`) gives every row the bits of `_sample_row`.

Checked bit for bit (tokens exactly, floats as raw float32 bits): batched softmax and `block / T` rows
against the per-row ops, batch sizes 1..64 and 1 and 2 threads; whole `sample` results against the
per-row reference for vocab 50, 1000 and 49152, random and flat logits, T in {0.5, 0.8, 1.3}, top_p in
{0.5, 0.9, 1.0}, top_k in {0, 50}, logprobs in {0, 5}; mixed batches; NaN / inf rows (per-row fallback);
and a negative control (a changed seed for one row is seen by the same comparison).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from deterministic_inference.engine import sampler, sampling_noise, seeded_batch
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.ops.portable import cumsum_rows, softmax_rows
from deterministic_inference.ops.selfcheck import torch_threads

THREADS = [1, 2]
INF = float("inf")
GUMBEL = (sampling_noise.gumbel_argmax, sampling_noise.gumbel_at)


def int_bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def row_bits(row: tuple[int, float, list[tuple[int, float]]]) -> tuple:
    """A row result with every float replaced by its raw float32 bits."""
    token, logprob, top = row
    floats = int_bits(torch.tensor([logprob, *[v for _, v in top]], dtype=torch.float32)).tolist()
    return token, floats, [t for t, _ in top]


def result_rows(result: sampler.SampleResult) -> list[tuple]:
    return [
        row_bits((result.token_ids[i], result.logprobs[i], result.top_logprobs[i]))
        for i in range(len(result.token_ids))
    ]


def make_logits(rows: int, vocab: int, seed: int, flat: bool = False) -> torch.Tensor:
    """[rows, vocab]: per-row scales from flat to peaked (or all tiny), some rows with -inf columns."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.tensor([0.05] if flat else [1.0, 3.0, 8.0])
    logits = torch.randn(rows, vocab, generator=gen) * scales[torch.arange(rows) % scales.numel()][:, None]
    masked = torch.rand(rows, vocab, generator=gen) < 0.3
    masked[torch.arange(rows) % 4 != 3] = False
    masked[:, 0] = False
    return logits.masked_fill(masked, -INF)


def run(logits: torch.Tensor, params: list[SamplingParams], positions: list[int] | None = None) -> list:
    rows = logits.shape[0]
    positions = positions or [3 + r for r in range(rows)]
    return result_rows(
        sampler.sample(logits, params, [100 + r for r in range(rows)], positions, [[1]] * rows, [[]] * rows)
    )


def reference(logits: torch.Tensor, params: list[SamplingParams]) -> list:
    return [
        row_bits(sampler._sample_row(logits[r], params[r], 100 + r, 3 + r, [1], []))
        for r in range(len(params))
    ]


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("vocab", [49152, 1000, 50])
def test_batched_softmax_and_scaling_rows_are_the_per_row_bits(vocab: int, threads: int) -> None:
    """softmax_rows(block / T) rows equal softmax_rows(row / T) for every batch size 1..64 (each
    at another start), and a batched softmax over [P, 50] sorted values too (the top-k path)."""
    logits = make_logits(64, vocab, seed=vocab)
    with torch_threads(1):
        scaled = [row / 0.8 for row in logits]
        reference_probs = [int_bits(softmax_rows(row)) for row in scaled]
        short = [int_bits(softmax_rows(row[:50].clone())) for row in scaled]
    mismatches = []
    with torch_threads(threads):
        for rows in range(1, 65):
            start = (rows * 37) % (65 - rows)
            block = logits[start : start + rows] / 0.8  # [rows, vocab]
            probs = softmax_rows(block)
            head = softmax_rows(block[:, :50].contiguous())
            for i in range(rows):
                if not torch.equal(int_bits(block[i]), int_bits(scaled[start + i])):
                    mismatches.append(("scaled", rows, start + i))
                if not torch.equal(int_bits(probs[i]), reference_probs[start + i]):
                    mismatches.append(("softmax", rows, start + i))
                if not torch.equal(int_bits(head[i]), short[start + i]):
                    mismatches.append(("softmax 50", rows, start + i))
    assert mismatches == []


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize(
    ("vocab", "rows", "flat"),
    [(50, 7, False), (1000, 9, False), (1000, 5, True), (49152, 6, False), (49152, 3, True)],
)
def test_seeded_rows_have_the_per_row_bits(vocab: int, rows: int, flat: bool, threads: int) -> None:
    logits = make_logits(rows, vocab, seed=vocab + rows, flat=flat)
    with torch_threads(threads):
        for temperature, top_p, top_k, k in itertools.product(
            [0.5, 0.8, 1.3], [0.5, 0.9, 1.0], [0, 50], [0, 5]
        ):
            params = [SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, logprobs=k)] * rows
            assert run(logits, params) == reference(logits, params), (temperature, top_p, top_k, k)


def test_every_batch_size_and_mixed_params_have_the_per_row_bits() -> None:
    """Batch sizes 1..64 with per-row T / top_p / top_k / logprobs drawn at random (several groups)."""
    logits = make_logits(64, 1000, seed=7)
    choices = list(itertools.product([0.5, 0.8, 1.3], [0.5, 0.9, 1.0], [0, 50, -1], [None, 0, 5]))
    gen = torch.Generator().manual_seed(3)
    picks = torch.randint(0, len(choices), (64,), generator=gen).tolist()
    params = [
        SamplingParams(temperature=t, top_p=p, top_k=k, logprobs=n)
        for t, p, k, n in (choices[i] for i in picks)
    ]
    expected = reference(logits, params)
    for rows in (1, 2, 5, 17, 32, 64):
        start = (rows * 37) % (65 - rows)
        got = result_rows(
            sampler.sample(
                logits[start : start + rows],
                params[start : start + rows],
                [100 + r for r in range(start, start + rows)],
                [3 + r for r in range(start, start + rows)],
                [[1]] * rows,
                [[]] * rows,
            )
        )
        assert got == expected[start : start + rows]


def test_mixed_batches_of_greedy_seeded_and_penalised_rows() -> None:
    logits = make_logits(8, 1000, seed=5)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.8, top_p=0.9, logprobs=5),
        SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.3),  # past [1]: penalised
        SamplingParams(temperature=1.3, top_k=50),
        SamplingParams(temperature=0.5, min_p=0.1),  # min_p: per-row path
        SamplingParams(temperature=0.0, repetition_penalty=1.2, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.5, top_k=50, logprobs=5),
        SamplingParams(temperature=0.8, frequency_penalty=0.5),  # no output yet: unchanged logits
    ]
    assert [seeded_batch.plain_seeded(p, [1], []) for p in params] == [
        False, True, False, True, False, False, True, True,
    ]  # fmt: skip
    batched = run(logits, params)
    assert batched == reference(logits, params)
    for r in range(8):
        alone = sampler.sample(logits[r : r + 1].clone(), [params[r]], [100 + r], [3 + r], [[1]], [[]])
        assert result_rows(alone) == [batched[r]]


def test_rows_with_nan_or_inf_fall_back_and_keep_the_per_row_bits() -> None:
    logits = make_logits(5, 1000, seed=11)
    logits[1, 17] = INF
    logits[2] = -INF
    logits[3, 40] = float("nan")
    params = [SamplingParams(temperature=0.8, top_p=0.9, logprobs=3)] * 5
    got = seeded_batch.seeded_rows(
        logits,
        params[0],
        [100 + r for r in range(5)],
        [3 + r for r in range(5)],
        [3] * 5,
        GUMBEL,
    )
    assert [row is None for row in got] == [False, True, True, True, False]
    kept = logits[[0, 1, 2, 4]]  # the NaN row raises in the per-row path, as before
    assert run(kept, params[:4]) == reference(kept, params[:4])


def test_negative_control_a_changed_seed_position_or_sum_is_seen() -> None:
    """The same comparison detects a one-row change of position or seed; and cumulative sums with a
    float32 accumulator (another rounding than cumsum_rows') differ in some bits from the sums the cut
    uses, while `_top_p_counts` gives every row the per-row survivor count."""
    logits = make_logits(16, 1000, seed=13)
    params = [SamplingParams(temperature=1.3, top_p=0.9, logprobs=5)] * 16
    expected = reference(logits, params)
    assert run(logits, params) == expected
    positions = [3 + r for r in range(16)]
    positions[5] += 1
    assert run(logits, params, positions) != expected
    seeds = [100 + r for r in range(16)]
    seeds[9] += 1
    other_seed = sampler.sample(logits, params, seeds, [3 + r for r in range(16)], [[1]] * 16, [[]] * 16)
    assert result_rows(other_seed) != expected
    scaled = logits / 1.3
    probs = softmax_rows(scaled)  # [16, 1000]
    ids, counts = seeded_batch._upper_sets(scaled, 1000)
    chosen = probs.gather(1, ids)  # [16, 1000], sorted by (-value, id)
    zero = torch.zeros_like(chosen[:, 0])  # [16]; a tensor start (same bits as the int 0) keeps sum's type
    float32_sums = torch.stack([sum(chosen[:, : i + 1].unbind(1), zero) for i in (99, 499, 999)], dim=1)
    cumsum = cumsum_rows(chosen)[:, [99, 499, 999]]
    assert not torch.equal(int_bits(float32_sums), int_bits(cumsum))
    kept, decided = seeded_batch._top_p_counts(chosen, counts, 0.9, 1000)
    assert bool(decided.all())
    assert kept.tolist() == [int(sampler._top_p_of_vocab(scaled[r], 0.9)[0].numel()) for r in range(16)]


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("vocab", [49152, 1000, 50])
def test_tied_logits_and_signed_zeros_have_the_per_row_bits(vocab: int, threads: int) -> None:
    """Quantized logits (ties everywhere, also at the top-k / top-p boundary), all-equal rows and rows of
    -0.0 / +0.0: the order by (-value, id) is exact, so these rows stay batched and match."""
    gen = torch.Generator().manual_seed(vocab)
    rows = [
        torch.randint(0, 4, (vocab,), generator=gen).to(torch.float32),
        torch.randint(0, 40, (vocab,), generator=gen).to(torch.float32) * 0.25,
        torch.zeros(vocab),
        torch.where(torch.rand(vocab, generator=gen) < 0.5, -0.0, 0.0),
    ]
    logits = torch.stack(rows)
    with torch_threads(threads):
        for top_p, top_k in itertools.product([0.5, 0.9, 1.0], [0, 50]):
            params = [SamplingParams(temperature=0.8, top_p=top_p, top_k=top_k, logprobs=5)] * 4
            got = seeded_batch.seeded_rows(
                logits, params[0], [100, 101, 102, 103], [3, 4, 5, 6], [0] * 4, GUMBEL
            )
            assert all(row is not None for row in got)  # (top logprobs of ties may fall back)
            assert run(logits, params) == reference(logits, params)


def test_overflowing_scaled_logits_fall_back() -> None:
    """A finite row whose logits / T overflow to +inf takes the per-row path (and matches it)."""
    logits = make_logits(3, 1000, seed=2)
    logits[1, 9] = 3e38
    params = [SamplingParams(temperature=0.5, top_p=0.9)] * 3
    got = seeded_batch.seeded_rows(logits, params[0], [100, 101, 102], [3, 4, 5], [0] * 3, GUMBEL)
    assert [row is None for row in got] == [False, True, False]
    assert run(logits, params) == reference(logits, params)
