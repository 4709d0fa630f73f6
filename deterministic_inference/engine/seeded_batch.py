"""The sampler's batched path for seeded rows: temperature > 0, no penalty, min_p 0, any top-k / top-p.

Such a row's token is a Gumbel argmax over the survivors of top-k / top-p of logits / T, and every step
`sampler._sample_row` takes for it has a row-exact batched form here (rows sharing (T, top_p, top-k)
are processed together; `sampler.sample` groups them):
  - raw logprobs: one `log_softmax_rows(block)`, bitwise `sampler._row_logprobs` per row (as in
    `greedy_batch`; the kernel computes each row alone, ops/logprobs.py -> ops/portable.py);
  - `block / T`: elementwise with the same Python scalar, so the same bits as `row / T`;
  - top-p probabilities: one `softmax_rows(scaled)` (same kernel argument as log_softmax; tested
    bitwise against the per-row `softmax_rows(row)`);
  - the sorted order by (-value, id): the elements >= a threshold m form an upper set of the row, so
    their order by unique integer keys (`greedy_batch.order_keys`) is exactly the first |U| entries of a
    full stable sort; m comes from block maxima, which only guarantees |U| >= what is needed;
  - top-p cut: a cumulative sum runs sequentially along a row, so the sums over a sorted prefix are the
    first entries of the per-row sums over any longer prefix; the per-row cut (first entry whose sum
    is not `< top_p`) is therefore found as soon as the prefix holds it (see `_top_p_counts`);
  - the token: the argmax of the exact float32 scores value + noise over all survivors, ties -> lowest id
    (`sampling_noise.gumbel_at`: per element integer hashing and exact-rounded arithmetic); the reference
    computes the same scores and only skips tokens that provably cannot win or tie. Rows with more than
    MAX_BATCHED survivors call `sampling_noise.gumbel_argmax` itself on the same (ids, values) tensors.
Rows whose logits or logits / T hold NaN or +inf, or have no finite maximum, are left to
`sampler._sample_row` (None), which stays the reference for every row.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from deterministic_inference.engine.greedy_batch import RowResult, best_rows, order_keys
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.ops.logprobs import log_softmax_rows
from deterministic_inference.ops.portable import cumsum_rows, softmax_rows

# Columns per block of the candidate search: small blocks keep the upper set found near its needed size.
WIDTH = 16
# Prefix lengths tried for top-p over the whole vocabulary (then the whole row), like the per-row loop.
_TOP_P_STEPS = (1024, 8192)
_LOW32 = (1 << 32) - 1
_INF = float("inf")

# Survivor counts up to which the Gumbel argmax runs batched (exact noise for every survivor); rows with
# more survivors call sampling_noise.gumbel_argmax, which computes the exact noise only where it can matter.
MAX_BATCHED = 4096
# sampling_noise.gumbel_argmax: (survivor ids, their values, seed, position) -> token
Picker = Callable[[torch.Tensor, torch.Tensor, int, int], int]
# sampling_noise.gumbel_at: (seeds [P], positions [P], token ids [P, S]) -> exact noise [P, S] float32
Noise = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (ids, values) of one row's survivors, ordered by (-value, id)
Survivors = tuple[torch.Tensor, torch.Tensor]


def plain_seeded(params: SamplingParams, past: list[int], output: list[int]) -> bool:
    """True when the row samples (temperature > 0) from logits that `sampler._apply_penalties` leaves
    unchanged (same conditions as there) with min_p off: the steps this module reproduces exactly."""
    repetition = params.repetition_penalty != 1.0 and bool(past)
    additive = (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0) and bool(output)
    return not params.greedy and params.min_p == 0.0 and not repetition and not additive


def _upper_sets(values: torch.Tensor, need: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row of `values` [P, V] (NaN-free), all its elements >= some threshold, at least `need` of
    them, ordered by (-value, id): (ids [P, C] int64 padded with junk, counts [P]). The threshold is the
    need-th largest maximum of WIDTH-strided column sets (each set reaching it holds an element >= it),
    or -inf (the whole row) when there are too few sets; the order is that of unique integer keys."""
    rows, vocab = values.shape
    sets = -(-vocab // WIDTH)
    if need >= sets:
        mask = torch.ones_like(values, dtype=torch.bool)  # [P, V]
    else:
        padded = values if vocab == sets * WIDTH else F.pad(values, (0, sets * WIDTH - vocab), value=-_INF)
        maxima = padded.view(rows, WIDTH, sets).amax(dim=1)  # [P, sets]: max of columns j, j + sets, ...
        threshold = torch.topk(maxima, need, dim=1).values[:, -1:]  # [P, 1]
        mask = values >= threshold  # [P, V]
    where_row, where_col = torch.nonzero(mask, as_tuple=True)  # [N], row-major
    counts = torch.bincount(where_row, minlength=rows)  # [P]
    starts = torch.cumsum(counts, dim=0) - counts  # [P]
    slots = torch.arange(where_row.numel()) - starts[where_row]  # [N]
    keys = torch.full((rows, int(counts.max())), torch.iinfo(torch.int64).min)  # [P, C]
    keys[where_row, slots] = order_keys(values[where_row, where_col], where_col)
    ordered = torch.sort(keys, dim=1, descending=True).values  # distinct keys: one order; padding last
    return (_LOW32 - (ordered & _LOW32)).clamp(max=vocab - 1), counts


def _top_p_counts(
    probs: torch.Tensor, counts: torch.Tensor, top_p: float, whole: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p cut of sorted prefixes: probs [P, C] (valid up to counts[p]) ordered by (-value, id) out of
    rows of `whole` entries. Returns (survivor counts [P], decided [P]). The per-row rule keeps entry 0
    and entry i while the sum of entries < i is `< top_p`; sums are sequential, so they agree with any
    longer prefix, and the cut is decided once a prefix's last sum is not `< top_p` (the per-row loop's
    float64 stop test implies this one) or the prefix is the whole row."""
    cumulative = cumsum_rows(probs)  # [P, C]
    below = cumulative < top_p  # [P, C]
    index = torch.arange(probs.shape[1])  # [C]
    before_last = index[None, :] < (counts[:, None] - 1)  # [P, C]
    kept = 1 + (below & before_last).sum(dim=1)  # [P]
    last = below.gather(1, (counts - 1)[:, None]).squeeze(1)  # [P]
    return kept, ~last | (counts == whole)


def _rows_of(values: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """values[rows] ([P, V]), without a copy when rows are all of them in order."""
    return values if rows == list(range(values.shape[0])) else values[torch.tensor(rows)]


def _top_p_of_vocab(scaled: torch.Tensor, top_p: float, rows: list[int]) -> dict[int, Survivors]:
    """Per-row `sampler._top_p_of_vocab` for the given rows of `scaled` [R, V]: the survivors of each
    row, found over growing upper sets until the cut is decided."""
    probs = softmax_rows(scaled)  # [R, V]; row r bitwise softmax_rows(scaled[r])
    found: dict[int, Survivors] = {}
    vocab = scaled.shape[1]
    for need in (*_TOP_P_STEPS, vocab):
        if not rows:
            break
        ids, counts = _upper_sets(_rows_of(scaled, rows), min(need, vocab))  # [P, C], [P]
        kept, decided = _top_p_counts(_rows_of(probs, rows).gather(1, ids), counts, top_p, vocab)
        values = _rows_of(scaled, rows).gather(1, ids)  # [P, C], row p: scaled[rows[p]][ids[p]]
        for r, row_ids, row_values, n, done in zip(
            rows, ids, values, kept.tolist(), decided.tolist(), strict=True
        ):
            if done:
                found[r] = row_ids[:n].clone(), row_values[:n].clone()
        rows = [r for r, done in zip(rows, decided.tolist(), strict=True) if not done]
    return found


def _top_k_then_p(scaled: torch.Tensor, top_k: int, top_p: float, rows: list[int]) -> dict[int, Survivors]:
    """Per-row top-k (`sampler._best`: the first top_k of the exact (-value, id) order), then top-p over
    the softmax of those top_k values in that order (a batched softmax over [P, top_k], row-exact)."""
    index = torch.tensor(rows)
    ids, _ = _upper_sets(scaled[index], top_k)  # [P, C], C >= top_k
    ids = ids[:, :top_k]  # [P, top_k]
    values = scaled[index].gather(1, ids)  # [P, top_k]
    kept = torch.full((len(rows),), top_k)
    if top_p < 1.0:
        counts = torch.full((len(rows),), top_k)
        kept, _ = _top_p_counts(softmax_rows(values), counts, top_p, top_k)
    return {
        r: (ids[p, : int(kept[p])].clone(), values[p, : int(kept[p])].clone()) for p, r in enumerate(rows)
    }


def _survivors(scaled: torch.Tensor, params: SamplingParams, rows: list[int]) -> dict[int, Survivors]:
    """Survivors of `sampler._filter` (min_p 0) for the given rows of `scaled` [R, V]."""
    vocab = scaled.shape[1]
    if 0 < params.top_k < vocab:
        return _top_k_then_p(scaled, params.top_k, params.top_p, rows)
    if params.top_p < 1.0:
        return _top_p_of_vocab(scaled, params.top_p, rows)
    return {r: (torch.arange(vocab, dtype=torch.int64), scaled[r]) for r in rows}


def _batched_argmax(
    survivors: list[Survivors], seeds: list[int], positions: list[int], noise: Noise
) -> list[int]:
    """`sampling_noise.gumbel_argmax` of each row's survivors at once: the exact float32 score value +
    noise of every survivor (padding scores -inf), the lowest id among each row's maximal scores. The
    reference skips the noise only of tokens that provably cannot win or tie (its docstring), so the
    argmax of the exact scores of all survivors is its token; every element here depends on its own
    (seed, position, id, value) only."""
    width = max(ids.numel() for ids, _ in survivors)
    ids = torch.zeros((len(survivors), width), dtype=torch.int64)  # [P, S], padded with id 0
    values = torch.full((len(survivors), width), -_INF)  # [P, S], padded with -inf
    for p, (row_ids, row_values) in enumerate(survivors):
        ids[p, : row_ids.numel()] = row_ids
        values[p, : row_values.numel()] = row_values
    scores = values + noise(torch.tensor(seeds), torch.tensor(positions), ids)  # [P, S]
    top = scores.amax(dim=1, keepdim=True)  # [P, 1], finite: every row holds its finite maximum
    winners = torch.where(scores == top, ids, torch.iinfo(torch.int64).max).amin(dim=1)  # [P]
    return winners.tolist()


def _tokens(
    survivors: dict[int, Survivors], seeds: list[int], positions: list[int], gumbel: tuple[Picker, Noise]
) -> dict[int, int]:
    """Each row's token: batched for rows with at most MAX_BATCHED survivors, `sampling_noise.gumbel_argmax`
    (the reference itself, on the same tensors) for the others."""
    pick, noise = gumbel
    small = [r for r, (ids, _) in survivors.items() if ids.numel() <= MAX_BATCHED]
    tokens = {
        r: pick(ids, values, seeds[r], positions[r])
        for r, (ids, values) in survivors.items()
        if r not in small
    }
    if small:
        batched = _batched_argmax(
            [survivors[r] for r in small], [seeds[r] for r in small], [positions[r] for r in small], noise
        )
        tokens.update(zip(small, batched, strict=True))
    return tokens


def seeded_rows(
    block: torch.Tensor,
    params: SamplingParams,
    seeds: list[int],
    positions: list[int],
    ks: list[int],
    gumbel: tuple[Picker, Noise],
    allowed: torch.Tensor | None = None,
) -> list[RowResult | None]:
    """Rows `block` [R, V] fp32 that all qualify (`plain_seeded`) with the same temperature, top-k and
    top-p (`params`; top-logprob counts `ks` per row): each row's (token, logprob, k best), bitwise what
    `sampler._sample_row` gives it, or None where a row must take the per-row path (non-finite maximum,
    NaN, or an inexact top-logprob search). `gumbel` is (`sampling_noise.gumbel_argmax`,
    `sampling_noise.gumbel_at`).
    allowed: grammar masks [R, V] bool or None; a disallowed token's scaled value is -inf, bitwise what
    `sampler._pick` divides (-inf / T is -inf), and logprobs stay the raw row's."""
    logprobs = log_softmax_rows(block)  # [R, V], row r bitwise sampler._row_logprobs(block[r])
    scaled = block / params.temperature  # [R, V], row r bitwise block[r] / T (same scalar op)
    if allowed is not None:
        scaled = scaled.masked_fill(~allowed, -_INF)
    usable = torch.isfinite(block.amax(dim=1)) & torch.isfinite(scaled.amax(dim=1))  # [R]; NaN propagates
    k = max(ks)
    best = torch.zeros((block.shape[0], 0), dtype=torch.int64)  # [R, k]
    if k > 0:
        best, exact = best_rows(logprobs, k)  # [R, k], [R]
        usable &= exact | torch.tensor([row_k == 0 for row_k in ks])
    rows = [r for r, ok in enumerate(usable.tolist()) if ok]
    results: list[RowResult | None] = [None] * block.shape[0]
    if not rows:
        return results
    survivors = _survivors(scaled, params, rows)
    tokens = _tokens(survivors, seeds, positions, gumbel)
    token_logprobs = logprobs.gather(1, torch.tensor([tokens.get(r, 0) for r in range(len(ks))])[:, None])
    best_ids, best_values = best.tolist(), logprobs.gather(1, best).tolist()  # [R, k]
    for r in rows:
        top = list(zip(best_ids[r][: ks[r]], best_values[r][: ks[r]], strict=True))
        results[r] = tokens[r], float(token_logprobs[r, 0]), top
    return results


def seeded_results(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int],
    positions: list[int],
    past_tokens: list[list[int]],
    output_tokens: list[list[int]],
    gumbel: tuple[Picker, Noise],
    masks: list[torch.Tensor | None] | None = None,
) -> dict[int, RowResult]:
    """`sampler.sample`'s batched seeded rows: the qualifying rows of `logits` [R, V], grouped by
    (temperature, top_p, top_k, constrained or not) and run through `seeded_rows`; row index -> result
    for every row the batched path decided (the others take the per-row path). A row's result depends on
    its own inputs only (its mask included), so the grouping never changes a bit."""
    row_masks = masks if masks is not None else [None] * len(params)
    groups: dict[tuple[float, float, int, bool], list[int]] = {}
    for r, row_params in enumerate(params):
        if plain_seeded(row_params, past_tokens[r], output_tokens[r]):
            key = (row_params.temperature, row_params.top_p, row_params.top_k, row_masks[r] is not None)
            groups.setdefault(key, []).append(r)
    found: dict[int, RowResult] = {}
    for key, group in groups.items():
        allowed = torch.stack([row_masks[r] for r in group]) if key[3] else None  # type: ignore[misc]
        block = logits[torch.tensor(group)].to(torch.float32)  # [G, V]
        batched = seeded_rows(
            block,
            params[group[0]],
            [seeds[r] for r in group],
            [positions[r] for r in group],
            [params[r].logprobs or 0 for r in group],
            gumbel,
            allowed,
        )
        found.update({r: row for r, row in zip(group, batched, strict=True) if row is not None})
    return found
