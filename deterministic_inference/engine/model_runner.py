"""Turns a `StepPlan` into model inputs, runs the model, and returns what the step computed.

`execute` gives the logits rows the plan asks for; `run` (one engine step's model work) also samples
them and returns a typed `ModelRunnerOutput`: the token sampled for each sequence, its logprobs, the
newly scored prompt positions, and the sequences whose own sampling or scoring failed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from deterministic_inference.engine.grammar_state import MaskFiller
from deterministic_inference.engine.kv_memory import lazy_kv_caches
from deterministic_inference.engine.plan import StepPlan
from deterministic_inference.model.decoder import DecoderModel, LayerHook
from deterministic_inference.ops.attention import AttentionMetadata

if TYPE_CHECKING:
    from deterministic_inference.engine.request import Request
    from deterministic_inference.engine.step_sampling import SampleFn


@dataclass(frozen=True)
class SampledToken:
    """The token one sequence sampled in a step."""

    token_id: int
    logprob: float  # log_softmax of the raw fp32 logits at token_id
    top_logprobs: list[tuple[int, float]]  # k best (token id, logprob); k = params.logprobs or 0


@dataclass(frozen=True)
class PromptLogprobs:
    """Logprobs of prompt positions one chunk scored (for requests that asked for prompt logprobs)."""

    first_position: int  # prompt position of values[0] (position p: logprob of prompt[p] given prompt[:p])
    values: list[float]
    top_logprobs: list[list[tuple[int, float]]]


@dataclass
class ModelRunnerOutput:
    """What one step computed, by sequence id (the plan's `ScheduledChunk.request_id`)."""

    sampled: dict[str, SampledToken] = field(default_factory=dict)  # chunks with `sample` that succeeded
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)  # sequence id -> request-scoped message
    # speculation: per sequence whose chunk had drafts, the tokens chosen AFTER `sampled` (each one
    # follows an accepted draft token, in order; the last may be the bonus or the first mismatch)
    accepted: dict[str, list[SampledToken]] = field(default_factory=dict)
    drafted: dict[str, int] = field(default_factory=dict)  # sequence id -> draft tokens verified


@dataclass(frozen=True)
class StepInputs:
    """Flat model inputs of one step."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    row_offsets: tuple[int, ...]  # first flat row of each chunk, in plan order


class ModelRunner:
    """Owns the paged KV cache tensors and executes step plans on a `DecoderModel`."""

    def __init__(
        self,
        model: DecoderModel,
        num_blocks: int,
        block_size: int,
        sample_fn: SampleFn | None = None,
        cache_dtype: torch.dtype | None = None,  # the KV cache format (torch.int8: q8_0); None: model dtype
    ) -> None:
        spec = model.spec
        self.model = model
        self.sample_fn = sample_fn  # None = sampler.sample (tests may wrap it to inject faults)
        self.masks = MaskFiller(spec.vocab_size)  # grammar masks, filled beside the forward pass
        self.block_size = block_size
        self.num_blocks = num_blocks
        dtype = model.numerics.dtype if cache_dtype is None else cache_dtype
        # kv_caches[layer] = (keys [blocks, KVH, D, block_size], values [blocks, KVH, block_size, D]) in the
        # cache format (ops/kv_format.py); resident only where written (see kv_memory)
        self.kv_caches = lazy_kv_caches(
            len(model.layers), num_blocks, block_size, spec.num_kv_heads, spec.head_dim, dtype
        )

    def prepare(self, plan: StepPlan) -> StepInputs:
        """Builds input ids, positions and the attention metadata (block tables) for a plan."""
        ids: list[int] = []
        positions: list[int] = []
        offsets: list[int] = []
        for chunk in plan.chunks:
            offsets.append(len(ids))
            ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_position, chunk.start_position + len(chunk.token_ids)))
        meta = AttentionMetadata.build(
            [(chunk.start_position, len(chunk.token_ids), chunk.block_ids) for chunk in plan.chunks],
            self.block_size,
        )
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            meta=meta,
            row_offsets=tuple(offsets),
        )

    def run(
        self, plan: StepPlan, sequences: Mapping[str, Request], layer_hook: LayerHook | None = None
    ) -> ModelRunnerOutput:
        """One step's model work: the logits (`execute`), then the sampled tokens and prompt logprobs of
        the plan's sequences (`step_sampling.sample_step`, which isolates per-sequence failures). The
        grammar masks of constrained rows are filled in a worker thread while `execute` runs: they depend
        only on tokens known before the step."""
        from deterministic_inference.engine.step_sampling import sample_step

        pending = self.masks.start(plan, sequences)
        logits = self.execute(plan, layer_hook)
        return sample_step(plan, logits, sequences, self.sample_fn, pending)

    def execute(self, plan: StepPlan, layer_hook: LayerHook | None = None) -> list[torch.Tensor | None]:
        """Runs one step. Returns, per chunk in plan order, fp32 logits [rows, vocab] or None.

        rows = every row of the chunk when `all_logits`, else its last row (and its drafted rows, the last
        `num_draft_tokens`) when `sample`, else None.
        All requested rows go through the logits head in ONE padded call (row-invariant).
        """
        inputs = self.prepare(plan)
        hidden = self.model.forward(
            inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches, layer_hook
        )
        wanted: list[range | None] = []
        for chunk, offset in zip(plan.chunks, inputs.row_offsets, strict=True):
            end = offset + len(chunk.token_ids)
            if chunk.all_logits:
                wanted.append(range(offset, end))
            elif chunk.sample:
                wanted.append(range(end - 1 - chunk.num_draft_tokens, end))  # + drafted positions
            else:
                wanted.append(None)
        rows = [row for span in wanted if span is not None for row in span]
        if not rows:
            return [None] * len(wanted)
        logits = self.model.logits(hidden[torch.tensor(rows, dtype=torch.int64)])  # [R, vocab] fp32
        results: list[torch.Tensor | None] = []
        cursor = 0
        for span in wanted:
            if span is None:
                results.append(None)
                continue
            results.append(logits[cursor : cursor + len(span)])
            cursor += len(span)
        return results
