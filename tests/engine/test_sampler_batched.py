"""The sampler's batched greedy path gives every row the bits of the per-row path (`_sample_row`).

Checked bit for bit (raw float32 bits, never float equality): batched log_softmax rows against
`_row_logprobs` for vocab 49152, 1000 and 256, every batch size 1..64 and 1 and 2 threads; the two-level
argmax (ties -> lowest id, including ties across block boundaries, -0.0 vs +0.0, all -inf and +inf rows)
and top-k (ties at the k-th value inside one block and across blocks) against the per-row reference; the
fallback of rows the batched search cannot decide exactly; and `as_batch` (a view, no copy, for rows that
sit back to back, as in a decode step).
"""

from __future__ import annotations

import random

import pytest
import torch

from deterministic_inference.engine import greedy_batch, sampler
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.ops.portable import log_softmax_rows
from deterministic_inference.ops.selfcheck import torch_threads

THREADS = [1, 2]
INF = float("inf")


def int_bits(x: torch.Tensor) -> torch.Tensor:
    """Raw float32 bits (so -0.0 != +0.0 and no tolerance can hide a difference)."""
    return x.contiguous().view(torch.int32)


def float_bits(values: list[float]) -> list[int]:
    return int_bits(torch.tensor(values, dtype=torch.float32)).tolist()


def row_bits(row: tuple[int, float, list[tuple[int, float]]]) -> tuple:
    """A row result with every float replaced by its raw bits."""
    token, logprob, top = row
    return token, float_bits([logprob]), [t for t, _ in top], float_bits([v for _, v in top])


def result_rows(result: sampler.SampleResult) -> list[tuple]:
    return [
        row_bits((result.token_ids[i], result.logprobs[i], result.top_logprobs[i]))
        for i in range(len(result.token_ids))
    ]


def random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """[rows, vocab] with per-row scales from flat to peaked, and a few rows with -inf (masked) columns."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.tensor([0.5, 3.0, 30.0])[torch.arange(rows) % 3]
    logits = torch.randn(rows, vocab, generator=gen) * scales[:, None]
    masked = torch.rand(rows, vocab, generator=gen) < 0.3
    masked[torch.arange(rows) % 4 != 3] = False
    masked[:, 0] = False  # every row keeps a finite entry
    return logits.masked_fill(masked, -INF)


def greedy(k: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, logprobs=k)


def sample_plain(logits: torch.Tensor, params: list[SamplingParams]) -> sampler.SampleResult:
    rows = logits.shape[0]
    return sampler.sample(logits, params, list(range(rows)), [3] * rows, [[1, 2]] * rows, [[2]] * rows)


def per_row_reference(logits: torch.Tensor, params: list[SamplingParams]) -> list[tuple]:
    """The per-row path's bits for each row (what every row got before the batched path existed)."""
    return [
        row_bits(sampler._sample_row(logits[r], params[r], r, 3, [1, 2], [2])) for r in range(len(params))
    ]


# -- log_softmax -------------------------------------------------------------------------------------


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("vocab", [49152, 1000, 256])
def test_batched_log_softmax_rows_are_the_per_row_logprobs_bit_for_bit(vocab: int, threads: int) -> None:
    """Every batch size 1..64, each taken at a different start (so rows also move position), against the
    per-row `_row_logprobs` computed once with 1 thread (so the thread count is covered too)."""
    logits = random_logits(64, vocab, seed=vocab)
    with torch_threads(1):
        reference = [int_bits(sampler._row_logprobs(row)) for row in logits]
    mismatches = []
    with torch_threads(threads):
        for rows in range(1, 65):
            start = (rows * 37) % (65 - rows)
            batched = log_softmax_rows(logits[start : start + rows])  # [rows, vocab]
            for i in range(rows):
                if not torch.equal(int_bits(batched[i]), reference[start + i]):
                    mismatches.append((rows, start + i))
    assert mismatches == []


def test_negative_control_an_equal_formula_gives_other_bits() -> None:
    """The comparison above sees 1-ulp differences: x - logsumexp(x), the same function on paper, differs
    from `_row_logprobs` in some bits."""
    logits = random_logits(8, 1000, seed=1000)
    other = logits - torch.logsumexp(logits, dim=1, keepdim=True)
    reference = torch.stack([sampler._row_logprobs(row) for row in logits])
    assert not torch.equal(int_bits(other), int_bits(reference))


def test_order_keys_order_like_value_descending_then_id() -> None:
    """Including -0.0 == +0.0 (ordered by id), denormals, infinities and equal values."""
    values = [0.0, -0.0, 1e-45, -1e-45, -INF, INF, 1.0, 1.0, -1.0, -2.5, 3e38, -3e38, -0.0, 0.0]
    columns = torch.tensor([7, 2, 40, 41, 0, 99, 12, 5, 1, 3, 8, 9, 6, 4])
    keys = greedy_batch.order_keys(torch.tensor(values), columns)
    by_key = columns[torch.argsort(keys, descending=True)].tolist()
    expected = [
        c for _, c in sorted(zip(values, columns.tolist(), strict=True), key=lambda vc: (-vc[0], vc[1]))
    ]
    assert by_key == expected
    assert len(set(keys.tolist())) == len(values)


# -- argmax and top-k ties ---------------------------------------------------------------------------


def tie_rows(vocab: int) -> tuple[torch.Tensor, list[int]]:
    """Rows built to stress the tie rules, and each row's expected token (lowest id of the maximum)."""
    gen = torch.Generator().manual_seed(vocab + 1)
    base = torch.randn(12, vocab, generator=gen)
    block = greedy_batch.BLOCK
    last = vocab - 1
    rows, tokens = [], []

    def add(row: torch.Tensor, token: int) -> None:
        rows.append(row)
        tokens.append(token)

    row = base[0].clone()
    row[[last, min(5 + block, last), 5]] = 9.0  # the same maximum in different blocks
    add(row, 5)
    row = base[1].clone()
    row[[min(block, last), min(block - 1, last)]] = 9.0  # on both sides of a block boundary
    add(row, min(block - 1, last))
    row = base[2].clone()
    row[last] = 9.0  # the maximum in the (short) last block
    add(row, last)
    row = -base[3].abs() - 1.0
    row[[min(200, last), min(3, last)]] = torch.tensor([0.0, -0.0])  # -0.0 == +0.0: the lower id wins
    add(row, min(3, last))
    add(torch.zeros(vocab), 0)  # everything ties
    add(torch.full((vocab,), -INF), 0)  # nothing finite: the per-row rule also gives id 0
    row = base[4].clone()
    row[[last, min(7, last)]] = INF
    add(row, min(7, last))
    row = base[5].clone()
    top = torch.randperm(vocab, generator=gen)[: min(40, vocab)]
    row[top] = 9.0  # 40 ids tie at the maximum: top-k ties at the k-th value across many blocks
    add(row, int(top.min()))
    row = torch.randint(0, 4, (vocab,), generator=gen).to(torch.float32)  # ties everywhere
    add(row, int(torch.nonzero(row == row.max())[0, 0]))
    row = base[6].clone()
    row[: min(3 * block, vocab)] = 6.0  # identical block maxima in the leading blocks, ties inside them
    add(row, 0)
    for r in range(7, 12):  # plain random rows
        add(base[r], int(torch.argmax(base[r])))
    return torch.stack(rows), tokens


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("vocab", [49152, 1000, 300, 256, 7])
def test_greedy_ties_go_to_the_lowest_id_and_every_row_has_the_per_row_bits(vocab: int, threads: int) -> None:
    logits, tokens = tie_rows(vocab)
    with torch_threads(threads):
        for k in (0, 1, 3, 20):
            params = [greedy(k)] * logits.shape[0]
            batched = sample_plain(logits, params)
            assert batched.token_ids == tokens
            assert result_rows(batched) == per_row_reference(logits, params)


@pytest.mark.parametrize("threads", THREADS)
def test_random_batches_of_mixed_logprob_counts_have_the_per_row_bits(threads: int) -> None:
    rng = random.Random(threads)
    with torch_threads(threads):
        for vocab, rows in ((49152, 64), (49152, 1), (1000, 33), (256, 17), (300, 5)):
            logits = random_logits(rows, vocab, seed=rows * vocab)
            params = [greedy(rng.choice([0, 0, 1, 2, 5, 20])) for _ in range(rows)]
            assert result_rows(sample_plain(logits, params)) == per_row_reference(logits, params)


def test_batched_search_declines_only_rows_it_cannot_decide_exactly() -> None:
    """Rows take the batched result unless it may be inexact: a NaN row, or more blocks than the top-k
    search takes (min(max k of the batch, blocks)) reaching its smallest block maximum. Those rows are left
    to the per-row path (None); the other rows of the batch keep the per-row bits."""
    vocab, block = 1000, greedy_batch.BLOCK
    logits = random_logits(5, vocab, seed=11)
    logits[1, 17] = float("nan")
    logits[2, [3, block + 3]] = 1000.0  # 2 blocks share the largest maximum
    logits[3, [3, block + 3, 2 * block + 3]] = 1000.0  # 3 blocks share it
    logits[4, [3, block + 3, 2 * block + 3, 3 * block + 3]] = 1000.0  # 4 blocks share it
    for k, declined in (
        (0, [False, True, False, False, False]),  # no top-k: only the NaN row
        (1, [False, True, True, True, True]),
        (2, [False, True, False, True, True]),
        (3, [False, True, False, False, True]),
    ):
        got = greedy_batch.greedy_rows(logits, [k] * 5)
        assert [row is None for row in got] == declined
        for r, row in enumerate(got):
            if row is not None:
                assert row_bits(row) == row_bits(sampler._sample_row(logits[r], greedy(k), 0, 0, [], []))
    # A smaller k elsewhere in the batch is covered by the batch's largest k: row 3 with k = 1 is exact.
    assert greedy_batch.greedy_rows(logits[[0, 3]], [3, 1])[1] is not None
    with pytest.raises(IndexError):  # NaN logits: the per-row path's behaviour, unchanged
        sample_plain(logits, [greedy(0)] * 5)


def test_mixed_batches_route_each_row_and_keep_its_bits() -> None:
    """Plain greedy rows next to sampled rows and greedy rows with penalties: every row equals its
    per-row result and itself alone."""
    logits = random_logits(8, 1000, seed=5)
    params = [
        greedy(3),
        SamplingParams(temperature=0.7, logprobs=3),
        greedy(0),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=2),
        SamplingParams(temperature=0.0, frequency_penalty=0.5),  # output [2] is not empty: penalized
        greedy(20),
        SamplingParams(top_p=0.9),
        greedy(1),
    ]
    assert [greedy_batch.plain_greedy(p, [1, 2], [2]) for p in params] == [
        True, False, True, False, False, True, False, True,
    ]  # fmt: skip
    batched = result_rows(sample_plain(logits, params))
    assert batched == per_row_reference(logits, params)
    for r in range(8):
        alone = sampler.sample(logits[r : r + 1].clone(), [params[r]], [r], [3], [[1, 2]], [[2]])
        assert result_rows(alone) == [batched[r]]


def test_decode_logprobs_of_greedy_rows_equal_prompt_logprobs_bitwise() -> None:
    logits = random_logits(40, 49152, seed=3)
    result = sample_plain(logits, [greedy(5)] * 40)
    values, tops = sampler.prompt_logprobs(logits, result.token_ids, 5)
    assert float_bits(values) == float_bits(result.logprobs)
    assert [[(t, float_bits([v])) for t, v in top] for top in tops] == [
        [(t, float_bits([v])) for t, v in top] for top in result.top_logprobs
    ]


# -- as_batch ---------------------------------------------------------------------------------------


def test_as_batch_views_back_to_back_rows_and_copies_the_others() -> None:
    logits = random_logits(6, 300, seed=2)  # the runner's logits of one step [R, V]
    decode = [logits[i : i + 1][-1] for i in range(6)]  # each chunk's last row, as Engine._sample takes them
    view = sampler.as_batch(decode)
    assert view.data_ptr() == logits.data_ptr() and view.shape == (6, 300)
    assert torch.equal(int_bits(view), int_bits(torch.stack(decode)))
    tail = sampler.as_batch(decode[2:])
    assert tail.data_ptr() == logits[2].data_ptr() and torch.equal(int_bits(tail), int_bits(logits[2:]))
    not_consecutive = [
        [logits[0:3][-1], logits[3:4][-1], logits[4:6][-1]],  # a chunk with all its rows in between
        [decode[1], decode[0]],  # out of order
        [decode[0], logits.clone()[1]],  # another storage
    ]
    for rows in not_consecutive:
        stacked = sampler.as_batch(rows)
        assert stacked.data_ptr() != logits.data_ptr()
        assert torch.equal(int_bits(stacked), int_bits(torch.stack(rows)))
