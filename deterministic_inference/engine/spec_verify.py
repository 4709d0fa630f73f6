"""Exact verification of drafted tokens: every position chooses its token as plain decoding would.

A chunk with drafts d_0..d_{K-1} computed the logits of K + 1 positions in one pass: row j predicts the
token after (known tokens + d_0..d_{j-1}). The engine guarantees that a position's logits do not depend
on how many positions are computed with it (decode == prefill, any chunking), so row j holds, bit for
bit, the logits plain decoding would compute at that position IF d_0..d_{j-1} are the tokens it chose.

Each row is then sampled by the plain sampler (`sampler.sample`, the same function plain decoding calls)
with exactly the inputs plain decoding would give it under that hypothesis: the sequence's seed, output
position len(output) + j (so the same counter-based Gumbel noise), past tokens and output tokens extended
by d_0..d_{j-1} (so the same penalties), and its grammar mask after d_0..d_{j-1}. Let t_j be row j's
token. The run t_0, t_1, ... is kept while t_j == d_j: by induction each kept t_j IS plain decoding's
token (its hypothesis held), and at the first j with t_j != d_j (or j == K) t_j is plain decoding's token
too and the run ends there. Rows after it are discarded: their hypothesis was false.

Why the usual rejection sampler is not exact: it accepts d_j with probability min(1, p(d_j) / q(d_j))
using a fresh uniform and, on rejection, draws from the residual max(0, p - q). Its output has the
target's DISTRIBUTION, but which token a given seed produces depends on the draft (on q, on whether the
draft was accepted, on the extra uniforms it consumed), so the same seeded request gives different
tokens with and without speculation, and with different drafts. Here the draft only decides how many
positions are verified per pass, never which token a position gets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deterministic_inference.engine import sampler
from deterministic_inference.engine.grammar_state import StepMasks, bitmask_to_allowed, fill_bitmask
from deterministic_inference.engine.model_runner import ModelRunnerOutput, SampledToken
from deterministic_inference.engine.request import Request
from deterministic_inference.engine.step_sampling import SampleFn, failure_message


@dataclass(frozen=True)
class DraftedChunk:
    """One sequence's drafted step: its draft tokens and the logits of its K + 1 verified rows."""

    sequence: Request
    drafts: tuple[int, ...]  # d_0..d_{K-1}
    logits: torch.Tensor  # [K + 1, V] fp32: row j predicts the token after d_0..d_{j-1}


def verify_drafts(
    chunks: list[DraftedChunk], sample_fn: SampleFn, out: ModelRunnerOutput, masks: StepMasks
) -> None:
    """Sample every hypothesis row of every drafted chunk in one `sample_fn` call, then keep each
    sequence's accepted run (module docstring): `out.sampled` gets t_0, `out.accepted` t_1..t_m. If the
    batched call raises, each sequence is retried alone and fails by itself if it raises again."""
    try:
        _verify(chunks, sample_fn, out, masks)
    except Exception as error:  # noqa: BLE001 - confined to the chunks' own sequences below
        if len(chunks) == 1:
            sequence_id = chunks[0].sequence.request_id
            out.failures[sequence_id] = failure_message(sequence_id, "sampling its next token", error)
            return
        for chunk in chunks:
            verify_drafts([chunk], sample_fn, out, masks)


def _verify(
    chunks: list[DraftedChunk], sample_fn: SampleFn, out: ModelRunnerOutput, masks: StepMasks
) -> None:
    rows: list[torch.Tensor] = []
    params, seeds, positions = [], [], []
    past: list[list[int]] = []
    outputs: list[list[int]] = []
    row_masks: list[torch.Tensor | None] = []
    for chunk in chunks:
        sequence = chunk.sequence
        known, produced = sequence.all_token_ids, sequence.output_token_ids
        hypothesis_masks = _hypothesis_masks(chunk, masks.allowed.get(sequence.request_id))
        for j in range(len(chunk.drafts) + 1):
            hypothesis = list(chunk.drafts[:j])
            rows.append(chunk.logits[j])  # [V]
            params.append(sequence.params)
            seeds.append(sequence.seed)
            positions.append(len(produced) + j)
            past.append(known + hypothesis)
            outputs.append(produced + hypothesis)
            row_masks.append(hypothesis_masks[j])
    logits = sampler.as_batch(rows)  # [R, V]: a view when the rows sit back to back (one chunk's do)
    result = sample_fn(logits, params, seeds, positions, past, outputs, row_masks)
    cursor = 0
    for chunk in chunks:
        run = _accepted_run(chunk.drafts, result, cursor)
        cursor += len(chunk.drafts) + 1
        sequence_id = chunk.sequence.request_id
        out.sampled[sequence_id] = run[0]
        out.accepted[sequence_id] = run[1:]
        out.drafted[sequence_id] = len(chunk.drafts)


def _accepted_run(drafts: tuple[int, ...], result: sampler.SampleResult, first: int) -> list[SampledToken]:
    """t_0..t_m from rows first..first + K of `result`: stops after the first t_j != d_j, or at t_K."""
    run: list[SampledToken] = []
    for j in range(len(drafts) + 1):
        row = first + j
        token = SampledToken(result.token_ids[row], result.logprobs[row], result.top_logprobs[row])
        run.append(token)
        if j == len(drafts) or token.token_id != drafts[j]:
            break
    return run


def _hypothesis_masks(chunk: DraftedChunk, first: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Grammar masks [V] bool of rows 0..K for a constrained sequence (all None otherwise): row 0's is
    the step's own mask (`first`, filled from the matcher before the step); row j's is the mask after
    its matcher consumed d_0..d_{j-1}, i.e. exactly the mask plain decoding computes there if those are
    its tokens. The matcher consumes only drafts its current mask allows (a disallowed d_j cannot equal
    t_j, so the run ends at j and later rows are never used: they get no mask) and is rolled back to
    its state before the step (llguidance `rollback`). The scheduler never drafts an ending token for a
    constrained sequence, so every consumed draft is a grammar token."""
    count = len(chunk.drafts) + 1
    grammar = chunk.sequence.grammar
    if grammar is None or first is None:
        return [None] * count
    vocab = first.shape[0]
    found: list[torch.Tensor | None] = [first]
    consumed = 0
    try:
        for draft in chunk.drafts:
            current = found[-1]
            if current is None or not bool(current[draft]) or not grammar.matcher.consume_token(draft):
                break
            consumed += 1
            bitmask = fill_bitmask(grammar.matcher, vocab)  # [1, W] int32
            allowed = bitmask_to_allowed(bitmask, vocab)[0].clone()  # [V]
            grammar.widen(allowed)
            found.append(allowed if bool(allowed.any()) and grammar.error is None else None)
    finally:
        if consumed:
            grammar.matcher.rollback(consumed)
    return found + [None] * (count - len(found))
