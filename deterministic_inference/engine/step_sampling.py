"""Sampling and prompt scoring of one step, with failures confined to the sequence they belong to.

All sampled rows go through ONE `sampler.sample` call (its batched paths). If that call raises, the rows
are sampled again one at a time: the rows that succeed get exactly the bits they would have had in the
batch (the sampler is row-invariant: a row's result is a function of that row alone, see
`engine/sampler.py`), and each row that still raises fails only its own sequence. Scoring prompt
positions (`sampler.prompt_logprobs`) is per chunk, so a failure there is that sequence's alone too.

Constrained rows: their grammar masks were filled beside the forward pass (`grammar_state.MaskFiller`);
they are joined here, before sampling, and each row gets its own mask. A row whose mask could not be
filled (its matcher failed) fails its own sequence and is not sampled.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch

from deterministic_inference.engine import sampler
from deterministic_inference.engine.grammar_state import PendingMasks, StepMasks
from deterministic_inference.engine.model_runner import ModelRunnerOutput, PromptLogprobs, SampledToken
from deterministic_inference.engine.plan import ScheduledChunk, StepPlan
from deterministic_inference.engine.request import Request
from deterministic_inference.engine.sampling_params import SamplingParams

logger = logging.getLogger("detinf.engine")

# sampler.sample's signature: (logits [R, V], params, seeds, positions, past tokens, output tokens,
# grammar masks [V] bool or None per row)
SampleFn = Callable[
    [
        torch.Tensor,
        list[SamplingParams],
        list[int],
        list[int],
        list[list[int]],
        list[list[int]],
        list[torch.Tensor | None],
    ],
    sampler.SampleResult,
]


def failure_message(sequence_id: str, stage: str, error: BaseException) -> str:
    """The request-scoped message a client sees (no traceback, no path); the traceback is logged."""
    logger.error("sequence %s failed while %s", sequence_id, stage, exc_info=error)
    return (
        f"the request failed inside the engine while {stage} ({type(error).__name__}); "
        "other requests were not affected"
    )


def sample_step(
    plan: StepPlan,
    logits: list[torch.Tensor | None],
    sequences: Mapping[str, Request],
    sample_fn: SampleFn | None = None,
    pending_masks: PendingMasks | None = None,
) -> ModelRunnerOutput:
    """Prompt logprobs of the chunks that asked for all rows, then one token for every chunk that ends
    its sequence's known tokens (`chunk.sample`). logits: per chunk, [rows, V] fp32 or None.
    pending_masks: the step's grammar masks being filled (joined here), None without constrained rows."""
    from deterministic_inference.engine.spec_verify import DraftedChunk, verify_drafts

    out = ModelRunnerOutput()
    masks = _join_masks(pending_masks, out)
    rows: list[torch.Tensor] = []
    sampled: list[Request] = []
    drafted: list[DraftedChunk] = []  # speculation: chunks whose drafted rows are verified
    for chunk, chunk_logits in zip(plan.chunks, logits, strict=True):
        sequence = sequences[chunk.request_id]
        if chunk.all_logits and chunk_logits is not None:
            _score_prompt(chunk, chunk_logits, sequence, out)
        if chunk.sample and chunk_logits is not None and chunk.request_id not in out.failures:
            if chunk.num_draft_tokens:
                drafts = chunk.token_ids[len(chunk.token_ids) - chunk.num_draft_tokens :]
                drafted.append(DraftedChunk(sequence, drafts, chunk_logits[-1 - len(drafts) :]))
                continue
            rows.append(chunk_logits[-1])  # [V]
            sampled.append(sequence)
    if rows:
        _sample_rows(rows, sampled, sample_fn or sampler.sample, out, masks)
    if drafted:
        verify_drafts(drafted, sample_fn or sampler.sample, out, masks)
    return out


def _join_masks(pending: PendingMasks | None, out: ModelRunnerOutput) -> StepMasks:
    """The step's masks; rows whose mask failed are recorded as their sequences' failures."""
    if pending is None:
        return StepMasks()
    masks = pending.result()
    for sequence_id, reason in masks.failures.items():
        logger.error("sequence %s failed while applying its grammar: %s", sequence_id, reason)
        out.failures[sequence_id] = (
            f"the request failed inside the engine while applying its grammar ({reason}); "
            "other requests were not affected"
        )
    return masks


def _sample_rows(
    rows: list[torch.Tensor],
    sequences: list[Request],
    sample_fn: SampleFn,
    out: ModelRunnerOutput,
    masks: StepMasks,
) -> None:
    try:
        result = sample_fn(
            sampler.as_batch(rows),  # [R, V]
            [s.params for s in sequences],
            [s.seed for s in sequences],
            [len(s.output_token_ids) for s in sequences],
            [s.all_token_ids for s in sequences],
            [s.output_token_ids for s in sequences],
            [masks.allowed.get(s.request_id) for s in sequences],
        )
    except Exception as error:  # noqa: BLE001 - confined to the rows' own sequences below
        if len(rows) == 1:
            out.failures[sequences[0].request_id] = failure_message(
                sequences[0].request_id, "sampling its next token", error
            )
            return
        for row, sequence in zip(rows, sequences, strict=True):
            _sample_rows([row], [sequence], sample_fn, out, masks)
        return
    for i, sequence in enumerate(sequences):
        out.sampled[sequence.request_id] = SampledToken(
            result.token_ids[i], result.logprobs[i], result.top_logprobs[i]
        )


def _score_prompt(
    chunk: ScheduledChunk, chunk_logits: torch.Tensor, sequence: Request, out: ModelRunnerOutput
) -> None:
    """Logprob of each prompt token given the tokens before it. Row r of the chunk predicts
    prompt[start + r + 1]; only positions the request has not collected yet are scored (a recompute
    after preemption, or a sibling choice, may already have them: same prompt, same bits)."""
    prompt = sequence.prompt_token_ids
    start = chunk.start_position
    collected = max(len(sequence.parent.prompt_logprobs), 1)  # position 0 never has a logprob
    first_row = max(0, collected - 1 - start)
    end_row = min(len(chunk.token_ids), len(prompt) - 1 - start)
    if first_row >= end_row:
        return
    targets = prompt[start + first_row + 1 : start + end_row + 1]
    try:
        values, tops = sampler.prompt_logprobs(
            chunk_logits[first_row:end_row], targets, sequence.params.prompt_logprobs or 0
        )
    except Exception as error:  # noqa: BLE001 - this sequence's failure alone
        out.failures[chunk.request_id] = failure_message(chunk.request_id, "scoring its prompt", error)
        return
    out.prompt_logprobs[chunk.request_id] = PromptLogprobs(start + first_row + 1, values, tops)
