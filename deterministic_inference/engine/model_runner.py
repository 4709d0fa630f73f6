"""Turns a `StepPlan` into model inputs, runs the model, and returns the logits rows the plan asks for."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deterministic_inference.engine.plan import ScheduledChunk, StepPlan
from deterministic_inference.model.llama import DecoderModel, LayerHook
from deterministic_inference.ops.attention import AttentionGroup, AttentionMetadata


@dataclass(frozen=True)
class StepInputs:
    """Flat model inputs of one step."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    row_offsets: tuple[int, ...]  # first flat row of each chunk, in plan order


class ModelRunner:
    """Owns the paged KV cache tensors and executes step plans on a `DecoderModel`."""

    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int) -> None:
        spec = model.spec
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        slots = num_blocks * block_size
        shape = (slots, spec.num_kv_heads, spec.head_dim)
        dtype = model.numerics.dtype
        # kv_caches[layer] = (keys, values), each [num_blocks * block_size, kv_heads, head_dim]
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in model.layers
        ]

    def prepare(self, plan: StepPlan) -> StepInputs:
        """Builds input ids, positions, cache slots and attention groups for a plan."""
        ids: list[int] = []
        positions: list[int] = []
        offsets: list[int] = []
        slots: list[int] = []
        for chunk in plan.chunks:
            offsets.append(len(ids))
            ids.extend(chunk.token_ids)
            chunk_positions = range(chunk.start_position, chunk.start_position + len(chunk.token_ids))
            positions.extend(chunk_positions)
            slots.extend(self._slot(chunk, position) for position in chunk_positions)
        groups = self._groups(plan.chunks, offsets)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64), groups=groups, num_tokens=len(ids)
        )
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            meta=meta,
            row_offsets=tuple(offsets),
        )

    def execute(self, plan: StepPlan, layer_hook: LayerHook | None = None) -> list[torch.Tensor | None]:
        """Runs one step. Returns, per chunk in plan order, fp32 logits [rows, vocab] or None.

        rows = every row of the chunk when `all_logits`, else its last row when `sample`, else None.
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
                wanted.append(range(end - 1, end))
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

    def _slot(self, chunk: ScheduledChunk, position: int) -> int:
        return chunk.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def _groups(self, chunks: tuple[ScheduledChunk, ...], offsets: list[int]) -> tuple[AttentionGroup, ...]:
        """Chunks grouped by query length (ascending), plan order inside a group."""
        by_length: dict[int, list[int]] = {}
        for index, chunk in enumerate(chunks):
            by_length.setdefault(len(chunk.token_ids), []).append(index)
        kv_tile = self.model.numerics.kv_tile
        groups = []
        for length in sorted(by_length):
            members = [chunks[i] for i in by_length[length]]
            seq_lens = [chunk.start_position + length for chunk in members]
            padded_len = -(-max(seq_lens) // kv_tile) * kv_tile
            row_index = torch.tensor(
                [[offsets[i] + r for r in range(length)] for i in by_length[length]], dtype=torch.int64
            )
            query_positions = torch.tensor(
                [[chunk.start_position + r for r in range(length)] for chunk in members], dtype=torch.int64
            )
            key_slots = torch.stack(
                [
                    self._key_slots(chunk, seq_len, padded_len)
                    for chunk, seq_len in zip(members, seq_lens, strict=True)
                ]
            )
            groups.append(
                AttentionGroup.build(
                    row_index,
                    query_positions,
                    key_slots,
                    tuple(seq_lens),
                    group_size=self.model.spec.group_size,
                    tile_rows=self.model.numerics.tile_rows,
                    kv_tile=kv_tile,
                )
            )
        return tuple(groups)

    def _key_slots(self, chunk: ScheduledChunk, seq_len: int, padded_len: int) -> torch.Tensor:
        """[padded_len] cache slots of keys 0..padded_len-1; keys at or past seq_len read slot 0 (masked)."""
        key_index = torch.arange(padded_len)
        blocks = torch.tensor(chunk.block_ids, dtype=torch.int64)
        block_of_key = torch.clamp(key_index // self.block_size, max=len(chunk.block_ids) - 1)
        slots = blocks[block_of_key] * self.block_size + key_index % self.block_size
        return torch.where(key_index < seq_len, slots, torch.zeros_like(slots))
