"""The sampler's batched greedy path: argmax, raw logprobs and top logprobs of many rows at once.

Rows that are plain greedy (temperature 0, no penalty that changes a logit) need only argmax + raw
logprobs + the k best logprobs, and `sampler.sample` computes those for all such rows at once:
  - one `ops.logprobs.log_softmax_rows(block)` (the one logprob function; its body is the portable
    kernel of ops/portable.py) computes each row alone, whole, in a source-fixed order, so every row is
    bitwise `sampler._row_logprobs` of that row; tests/engine/test_sampler_batched.py checks this bit
    for bit for several vocab sizes, 1..64 rows and 1 and 2 threads;
  - argmax and top-k as a two-level search over blocks of `BLOCK` columns: block maxima (`amax`, exact
    whatever its reduction order), then the exact answer inside the few blocks that can hold it. Ties go to
    the lowest id by construction (torch.argmax returns the first maximal index; top-k orders unique
    integer keys built from (value, id)), so no result depends on the reduction order or the thread count.
A row whose exactness condition fails (NaN logits or logprobs, or a tie between block maxima at the top-k
boundary) falls back to the per-row path (`sampler._sample_row`), which stays the reference for every row.
"""

from __future__ import annotations

import torch

from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.ops import portable
from deterministic_inference.ops.logprobs import log_softmax_rows

# Columns per block of the two-level argmax / top-k search (any value >= 1 gives the same results; 128
# keeps both the block maxima [R, V / 128] and the candidate blocks small).
BLOCK = 128
_LOW32 = (1 << 32) - 1

# (token id, raw logprob of the token, k best (id, logprob)) of one row
RowResult = tuple[int, float, list[tuple[int, float]]]


def plain_greedy(params: SamplingParams, past: list[int], output: list[int]) -> bool:
    """True when the row's token is the lowest-id argmax of its raw logits: temperature 0 and
    `sampler._apply_penalties` would return the logits unchanged (same conditions as there)."""
    repetition = params.repetition_penalty != 1.0 and bool(past)
    additive = (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0) and bool(output)
    return params.greedy and not repetition and not additive


def _block_maxima(values: torch.Tensor) -> torch.Tensor:
    """Row maxima of consecutive column blocks of `BLOCK` (the last one may be shorter): [R, V] ->
    [R, ceil(V / BLOCK)]. A maximum is exact whatever order amax reduces in (only the sign of a zero
    maximum may vary, and -0.0 == +0.0 in every comparison made with it); NaN propagates."""
    vocab = values.shape[1]
    full = vocab // BLOCK * BLOCK
    parts = []
    if full:
        parts.append(values[:, :full].unflatten(1, (full // BLOCK, BLOCK)).amax(dim=2))
    if full < vocab:
        parts.append(values[:, full:].amax(dim=1, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _block_columns(blocks: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Column ids of the given blocks [R, C] as [R, C * BLOCK], block by block, and which of them are
    real (< vocab; columns past the short last block are clamped to vocab - 1 so they can be gathered)."""
    columns = (blocks[:, :, None] * BLOCK + torch.arange(BLOCK)).flatten(1)  # [R, C * BLOCK]
    return columns.clamp(max=vocab - 1), columns < vocab


def _argmax_rows(values: torch.Tensor, maxima: torch.Tensor) -> torch.Tensor:
    """Per row of `values` [R, V] with block maxima `maxima` (`_block_maxima(values)`), the lowest index of
    the maximum: [R] int64 (meaningless for a row with NaN). Exact: the first block whose maximum equals
    the row maximum holds the first maximal column, and torch.argmax returns the first maximal index both
    among the block maxima and inside that block (clamped duplicates of the last column come after it, so
    they never win over an earlier equal one)."""
    first_block = torch.argmax(maxima, dim=1, keepdim=True)  # [R, 1]
    columns, _ = _block_columns(first_block, values.shape[1])  # [R, BLOCK]
    inside = torch.argmax(values.gather(1, columns), dim=1, keepdim=True)  # [R, 1]
    return columns.gather(1, inside).squeeze(1)


def order_keys(values: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered like (value descending, column ascending) for NaN-free fp32 values: the float
    bits mapped to a monotone int32 (-0.0 and +0.0 to the same key, as they compare equal) in the high
    half, 2**32 - 1 - column in the low half. Keys of distinct columns are distinct, so any top-k of them
    has exactly one order."""
    bits = values.contiguous().view(torch.int32).to(torch.int64)
    monotone = torch.where(bits < 0, (bits ^ 0x7FFFFFFF) + 1, bits)  # in [-2**31 + 1, 2**31 - 1]
    return monotone * (1 << 32) + (_LOW32 - columns)


def best_rows(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best columns per row by (-value, id) of `logprobs` [R, V], ordered: (ids [R, k] int64, exact
    [R] bool). Row r's ids equal `sampler._best(logprobs[r], k)` wherever exact[r]:

    the kb = min(k, blocks) blocks with the largest maxima hold at least kb elements >= the kb-th block
    maximum m, so the k-th best value is >= m and every element that can be among the k best (ties at the
    k-th value included) sits in a block whose maximum is >= m. When exactly kb blocks reach m (no other
    block ties it) and the row has no NaN, those blocks hold all of them, and a top-k of the unique
    (value, id) keys over their columns is the exact answer; otherwise exact[r] is False."""
    vocab = logprobs.shape[1]
    k = min(k, vocab)
    maxima = _block_maxima(logprobs)  # [R, blocks]
    top_blocks = torch.topk(maxima, min(k, maxima.shape[1]), dim=1)  # [R, kb]
    reach = (maxima >= top_blocks.values[:, -1:]).sum(dim=1)  # [R]; NaN compares False
    exact = (reach == top_blocks.values.shape[1]) & ~torch.isnan(maxima).any(dim=1)
    columns, real = _block_columns(top_blocks.indices, vocab)  # [R, kb * BLOCK]
    keys = order_keys(logprobs.gather(1, columns), columns)
    keys = keys.masked_fill(~real, torch.iinfo(torch.int64).min)  # clamped duplicates never rank
    best = torch.topk(keys, k, dim=1).values  # [R, k], distinct keys, descending
    return _LOW32 - (best & _LOW32), exact


def greedy_rows(
    block: torch.Tensor, ks: list[int], allowed: torch.Tensor | None = None
) -> list[RowResult | None]:
    """Plain greedy rows `block` [R, V] fp32 with top-logprob counts ks: each row's (token, logprob, k
    best), bitwise what `sampler._sample_row` gives it, or None where the batched search is not exact
    (the caller then uses `sampler._sample_row`). Every op below works on each row alone (see the module
    docstring). Rows asking for no top logprobs take one kernel pass (`portable.greedy_rows`: the same
    token and logprob bits, without the row's other logprobs). allowed: grammar masks [R, V] bool (the
    token is the argmax of the masked row, logprobs stay those of the raw row), or None."""
    if allowed is not None:
        return _masked_greedy_rows(block, ks, allowed)
    if max(ks) == 0 and block.shape[1] > 0:
        found = portable.greedy_rows(block)
        if found is not None:
            return [(token, value, []) if ok else None for token, value, ok in zip(*found, strict=True)]
    logprobs = log_softmax_rows(block)  # [R, V], row r bitwise sampler._row_logprobs(block[r])
    maxima = _block_maxima(block)  # [R, blocks]
    usable = ~torch.isnan(maxima).any(dim=1)  # [R]; NaN logits: the per-row path decides
    tokens = _argmax_rows(block, maxima)  # [R]
    return _row_results(logprobs, tokens, usable, ks)


def _row_results(
    logprobs: torch.Tensor, tokens: torch.Tensor, usable: torch.Tensor, ks: list[int]
) -> list[RowResult | None]:
    """Each row's (token, its logprob, the k best (id, logprob)) from logprobs [R, V], chosen tokens [R]
    and usable [R] bool; None for rows not usable or whose top-logprob search is not exact. Row-wise:
    gathers and `best_rows` read each row alone."""
    token_logprobs = logprobs.gather(1, tokens[:, None]).squeeze(1)  # [R]
    k = max(ks)
    tops: list[list[tuple[int, float]]] = [[] for _ in ks]
    if k > 0:
        ids, exact = best_rows(logprobs, k)  # [R, k], [R]
        usable = usable & (exact | torch.tensor([row_k == 0 for row_k in ks]))
        id_lists, value_lists = ids.tolist(), logprobs.gather(1, ids).tolist()
        tops = [
            list(zip(i[:row_k], v[:row_k], strict=True))
            for i, v, row_k in zip(id_lists, value_lists, ks, strict=True)
        ]
    found = zip(tokens.tolist(), token_logprobs.tolist(), tops, usable.tolist(), strict=True)
    return [(token, value, top) if ok else None for token, value, top, ok in found]


def _masked_greedy_rows(block: torch.Tensor, ks: list[int], allowed: torch.Tensor) -> list[RowResult | None]:
    """`greedy_rows` of constrained rows: the lowest-id argmax of each row with its disallowed tokens at
    -inf (`sampler._pick`'s masked_fill, the same elementwise op), raw logprobs and top logprobs of the
    unmasked row. Rows with NaN logits, or whose top-logprob search is not exact, give None."""
    masked = block.masked_fill(~allowed, float("-inf"))  # [R, V]
    logprobs = log_softmax_rows(block)  # [R, V], raw: before the mask
    usable = ~torch.isnan(_block_maxima(block)).any(dim=1)  # [R]
    tokens = _argmax_rows(masked, _block_maxima(masked))  # [R]
    return _row_results(logprobs, tokens, usable, ks)


def greedy_batches(
    logits: torch.Tensor,
    params: list[SamplingParams],
    past_tokens: list[list[int]],
    output_tokens: list[list[int]],
    masks: list[torch.Tensor | None],
    rows: list[RowResult | None],
) -> None:
    """Fill `rows` [R] for the plain greedy rows of `logits` [R, V] through `greedy_rows`: unconstrained
    rows in one call, constrained rows (with their masks) in another; each row's result depends on its
    own inputs only, so the grouping cannot change a bit."""
    greedy = [r for r in range(logits.shape[0]) if plain_greedy(params[r], past_tokens[r], output_tokens[r])]
    for masked in (False, True):
        group = [r for r in greedy if (masks[r] is not None) == masked]
        if not group:
            continue
        block = logits if len(group) == logits.shape[0] else logits[torch.tensor(group)]
        allowed = torch.stack([masks[r] for r in group]) if masked else None  # type: ignore[misc]
        batched = greedy_rows(block.to(torch.float32), [params[r].logprobs or 0 for r in group], allowed)
        for r, row in zip(group, batched, strict=True):
            rows[r] = row
