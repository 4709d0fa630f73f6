"""Token sampling as pure functions of (logits row, params, seed, output position, past tokens).

Row independence. The per-row path (`_sample_row`, any params) processes a row on its own 1-D fp32 copy
with row-wise ops only (penalty gathers, division, log_softmax, softmax, stable sort, cumsum, max); the
batched greedy path (below) uses ops that reduce along a row only (log_softmax, amax, argmax, topk,
gather). Nothing reduces across rows, so a row's token and logprob bits do not depend on the other rows,
their number or the row's position.

Portable bits. Every operation here that rounds is either one IEEE operation that every torch kernel
rounds the same way (+, -, *, / of a tensor and a scalar or another tensor, comparisons, casts), or runs in
the compiled kernels (`ops/portable.py`: `log_softmax_rows`, `softmax_rows`, `cumsum_rows`, each row alone
in a source-fixed order with our own exp and log). torch's own log_softmax / softmax dispatch on the CPU's
ISA (AVX-512, AVX2 and scalar builds round differently), so they never appear on this path; the rest is
exact whatever the order or the thread count (max, argmax with its first-index rule, topk and sorts of
unique keys, integer ops). So a row's bits are the same on any x86-64 CPU and for any thread count.

Randomness is counter-based Gumbel-max: the noise of (seed, output position, token id) is an integer hash
computed with int64 torch ops, mapped to a uniform in (0, 1) and then to Gumbel noise -log(-log(u)) with
a logarithm written in +, -, *, / (`log64`), so no vectorized-vs-scalar libm path can change a bit.
The token is argmax(filtered logits / T + noise), ties to the lowest token id. No generator, no global
RNG: the same (seed, position) gives the same token whatever else runs.

Order of operations per row (documented choice, vLLM/HF semantics):
  1. penalties on the raw logits: repetition (HF: positive logits divided, negative multiplied) over
     prompt + output tokens; then frequency (count * f) and presence (p once) subtracted over output tokens;
  1b. structured output: tokens the row's grammar mask disallows become -inf (the mask is the row's own,
     a function of its grammar and its own tokens: `engine/grammar_state.py`);
  2. temperature 0: argmax, ties -> lowest id (filters cannot change the argmax);
  3. else logits / T, then top-k, then top-p (softmax over the top-k survivors, sorted by (-value, id)
     with a STABLE sort, keep the shortest prefix whose mass reaches top_p), then min-p (softmax over
     the survivors, keep p >= min_p * max p); ties always broken by token id;
  4. token = argmax over survivors of (value + gumbel noise), ties -> lowest id.

Logprobs are "raw": log_softmax of the model's fp32 logits row, BEFORE penalties, the grammar mask,
temperature and filters (vLLM's "raw_logprobs"), always through `ops.portable.log_softmax_rows`, the one
function that turns logits into logprobs (a trainer's forward pass calls it too, through the ops
backend). Decode logprobs therefore equal, bitwise, the prompt logprobs of the same sequence scored in
one prefill (`prompt_logprobs` uses the same row function): the RL contract. Constrained rows keep it on
every path: their logprobs are the model's, not renormalized over the tokens the grammar allows, and
top_logprobs may list tokens the grammar forbade (the chosen token is always an allowed one).

Plain greedy rows take a batched path (`greedy_batch`), and seeded rows without penalties or min-p
another (`seeded_batch`); both give every row the same bits as `_sample_row`, and rows they cannot prove
exact fall back to `_sample_row`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deterministic_inference.engine.greedy_batch import RowResult, greedy_batches
from deterministic_inference.engine.sampling_noise import gumbel_argmax, gumbel_at
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.engine.seeded_batch import seeded_results
from deterministic_inference.ops.logprobs import log_softmax_rows
from deterministic_inference.ops.portable import cumsum_rows, softmax_rows


@dataclass
class SampleResult:
    """Per row: the chosen token, its raw logprob and the k best (token id, logprob) alternatives."""

    token_ids: list[int]
    logprobs: list[float]  # log_softmax of the raw fp32 logits at the chosen token
    top_logprobs: list[list[tuple[int, float]]]  # k best by (-logprob, id); k = params.logprobs or 0


# -- row helpers -------------------------------------------------------------------------------------


def _row_logprobs(row: torch.Tensor) -> torch.Tensor:
    """log_softmax of one raw logits row [V] in fp32 through `ops.logprobs.log_softmax_rows` (shared by
    `sample`, `prompt_logprobs`, the batched paths and the RL policy, so every logprob of the same logits
    row has the same bits)."""
    return log_softmax_rows(row.reshape(1, -1))[0]


def _best(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best entries by (-value, id): (ids, values), ordered. Exact: topk only finds the k-th value;
    the order comes from a stable sort of the ids (ascending) at or above it."""
    k = min(k, values.numel())
    threshold = torch.topk(values, k).values[-1]
    ids = torch.nonzero(values >= threshold).squeeze(1)
    order = torch.sort(values[ids], descending=True, stable=True).indices[:k]
    return ids[order], values[ids[order]]


def _top_pairs(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    ids, values = _best(logprobs, k)
    return list(zip(ids.tolist(), values.tolist(), strict=True))


def _argmax_lowest(values: torch.Tensor) -> int:
    """Index of the maximum, ties -> lowest index."""
    return int(torch.nonzero(values == values.max())[0, 0])


def _apply_penalties(
    raw: torch.Tensor, params: SamplingParams, past: list[int], output: list[int]
) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens, then frequency and presence over output tokens."""
    logits = raw.clone()
    if params.repetition_penalty != 1.0 and past:
        ids = torch.unique(torch.tensor(past, dtype=torch.int64))
        chosen = logits[ids]
        penalty = params.repetition_penalty
        logits[ids] = torch.where(chosen > 0, chosen / penalty, chosen * penalty)
    if (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0) and output:
        counts = torch.bincount(torch.tensor(output, dtype=torch.int64))
        ids = torch.nonzero(counts).squeeze(1)
        chosen = logits[ids] - counts[ids].to(torch.float32) * params.frequency_penalty
        logits[ids] = chosen - params.presence_penalty
    return logits


def _top_p_prefix(
    ids: torch.Tensor, values: torch.Tensor, probs: torch.Tensor, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shortest prefix of (ids, values), sorted by (-value, id), whose probabilities `probs` add up
    to top_p (cumulative sums in that order; the first entry is always kept)."""
    cumulative = cumsum_rows(probs)
    keep = torch.ones_like(cumulative, dtype=torch.bool)
    keep[1:] = cumulative[:-1] < top_p
    return ids[keep], values[keep]


def _top_p_of_vocab(scaled: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p over a whole row without sorting it: softmax of the row in token order, then the best k
    tokens by (-value, id) for k = 256, 1024, ... until their probabilities reach top_p. Each step is a
    function of the row alone (softmax over the whole row, exact top-k order), so the survivors are too;
    the prefix found is the one a full sort would give, summed in the same sorted order."""
    probs = softmax_rows(scaled)  # [V], token order
    vocab, k = scaled.numel(), min(256, scaled.numel())
    while True:
        ids, values = _best(scaled, k)
        chosen = probs[ids]
        if k == vocab or float(cumsum_rows(chosen)[-1]) >= top_p:
            return _top_p_prefix(ids, values, chosen, top_p)
        k = min(vocab, 4 * k)


def _filter(scaled: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Survivors of top-k, top-p, min-p as (ids, values); ties broken by token id."""
    vocab = scaled.numel()
    if 0 < params.top_k < vocab:
        ids, values = _best(scaled, params.top_k)
        if params.top_p < 1.0:  # values are sorted by (-value, id) here
            ids, values = _top_p_prefix(ids, values, softmax_rows(values), params.top_p)
    elif params.top_p < 1.0:
        ids, values = _top_p_of_vocab(scaled, params.top_p)
    else:
        ids, values = torch.arange(vocab, dtype=torch.int64), scaled
    if params.min_p > 0.0:
        probs = softmax_rows(values)
        keep = probs >= probs.max() * params.min_p
        ids, values = ids[keep], values[keep]
    return ids, values


def _pick(
    raw: torch.Tensor,
    params: SamplingParams,
    seed: int,
    position: int,
    past: list[int],
    output: list[int],
    allowed: torch.Tensor | None = None,
) -> int:
    """The token of one row (see the module docstring for the order of operations); allowed: [V] bool
    grammar mask or None."""
    logits = _apply_penalties(raw, params, past, output)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, -math.inf)
    if params.greedy:
        return _argmax_lowest(logits)
    ids, values = _filter(logits / params.temperature, params)
    return gumbel_argmax(ids, values, seed, position)


def _sample_row(
    row: torch.Tensor,
    params: SamplingParams,
    seed: int,
    position: int,
    past: list[int],
    output: list[int],
    allowed: torch.Tensor | None = None,
) -> RowResult:
    """The per-row path (any params): the reference every other path of a row must match bit for bit."""
    raw = row.to(torch.float32).clone()
    logprobs = _row_logprobs(raw)
    token = _pick(raw, params, seed, position, past, output, allowed)
    return token, float(logprobs[token]), _top_pairs(logprobs, params.logprobs or 0)


def _check_batch(logits: torch.Tensor, lengths: dict[str, int]) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [rows, vocab], got shape {tuple(logits.shape)}")
    for name, length in lengths.items():
        if length != logits.shape[0]:
            raise ValueError(f"{name}: {length} entries for {logits.shape[0]} logits rows")


# -- public API ----------------------------------------------------------------------------------


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int],
    positions: list[int],
    past_tokens: list[list[int]],
    output_tokens: list[list[int]],
    masks: Sequence[torch.Tensor | None] | None = None,
) -> SampleResult:
    """One token per row of `logits` [R, V]. Row r uses only logits[r], params[r], seeds[r], positions[r]
    (the row's OUTPUT position, i.e. tokens generated so far), past_tokens[r] (prompt + output, for the
    repetition penalty), output_tokens[r] and masks[r] (its grammar's allowed tokens [V] bool, or None):
    its result is bitwise the same alone or in any batch.

    Plain greedy rows (`greedy_batch`) and plain seeded rows (`seeded_batch`) go through batched paths,
    every other row (and any batched row whose exactness condition fails) through `_sample_row`; all give
    the same bits for a row (see the module docstring), so which rows share a batch never changes a
    result."""
    _check_batch(
        logits,
        {
            "params": len(params),
            "seeds": len(seeds),
            "positions": len(positions),
            "past_tokens": len(past_tokens),
            "output_tokens": len(output_tokens),
        },
    )
    row_masks: list[torch.Tensor | None] = list(masks) if masks is not None else [None] * logits.shape[0]
    _check_batch(logits, {"masks": len(row_masks)})
    rows: list[RowResult | None] = [None] * logits.shape[0]
    greedy_batches(logits, params, past_tokens, output_tokens, row_masks, rows)
    seeded = seeded_results(
        logits, params, seeds, positions, past_tokens, output_tokens, (gumbel_argmax, gumbel_at), row_masks
    )
    for r, found in seeded.items():
        rows[r] = found
    result = SampleResult(token_ids=[], logprobs=[], top_logprobs=[])
    for r, row in enumerate(rows):
        if row is None:
            row = _sample_row(
                logits[r], params[r], seeds[r], positions[r], past_tokens[r], output_tokens[r], row_masks[r]
            )
        result.token_ids.append(row[0])
        result.logprobs.append(row[1])
        result.top_logprobs.append(row[2])
    return result


def as_batch(rows: list[torch.Tensor]) -> torch.Tensor:
    """Logits rows [V] as one [n, V] tensor for `sample`: a view without a copy when they sit back to back
    in one storage (a decode step: every chunk samples its only row of the model runner's logits), else a
    stacked copy. Either way the values are the rows' own, so no sampled bit can differ."""
    first = rows[0]
    vocab = first.shape[0]
    consecutive = first.dim() == 1 and first.stride(0) == 1
    for i, row in enumerate(rows):
        consecutive = consecutive and (
            row.shape == first.shape
            and row.stride() == first.stride()
            and row.dtype == first.dtype
            and row.device == first.device
            and row.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and row.storage_offset() == first.storage_offset() + i * vocab
        )
    if consecutive:
        return first.as_strided((len(rows), vocab), (vocab, 1))  # [n, V] view of the same memory
    return torch.stack(rows)  # [n, V] copy


def prompt_logprobs(
    logits: torch.Tensor, next_token_ids: list[int], k: int
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Row p of `logits` [P, V] predicts next_token_ids[p]: its raw logprob and the k best alternatives.
    Same row function as `sample`, so the bits equal the decode logprobs of the same logits rows."""
    _check_batch(logits, {"next_token_ids": len(next_token_ids)})
    values, tops = [], []
    for p in range(logits.shape[0]):
        logprobs = _row_logprobs(logits[p])
        values.append(float(logprobs[next_token_ids[p]]))
        tops.append(_top_pairs(logprobs, k))
    return values, tops
