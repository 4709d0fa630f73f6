"""Packing sequences for the policy's forward: flat tokens, positions and attention metadata.

Every sequence is packed whole, from position 0, with its own consecutive blocks of a scratch paged
cache, so each token attends over exactly its own sequence's keys, in ascending key order, as in the
engine. Padding never reaches the model: padded batches are unpadded here first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deterministic_inference.errors import InvalidRequestError
from deterministic_inference.ops.attention import AttentionMetadata


@dataclass(frozen=True)
class PackedBatch:
    """Sequences one after another: token t of sequence i is flat row starts[i] + t."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    num_blocks: int  # scratch cache blocks the batch needs
    starts: tuple[int, ...]  # first flat row of each sequence
    lengths: tuple[int, ...]  # tokens of each sequence


def pack(sequences: Sequence[Sequence[int]], block_size: int, vocab_size: int) -> PackedBatch:
    """Flat inputs of whole sequences (each at least 2 tokens, ids in [0, vocab_size))."""
    if not sequences:
        raise InvalidRequestError("sequences: give at least one sequence", param="sequences")
    ids: list[int] = []
    positions: list[int] = []
    starts: list[int] = []
    tables: list[tuple[int, int, list[int]]] = []
    next_block = 0
    for index, sequence in enumerate(sequences):
        tokens = [int(token) for token in sequence]
        if len(tokens) < 2:
            raise InvalidRequestError(
                f"sequences[{index}]: {len(tokens)} tokens; a scored sequence needs at least 2", "sequences"
            )
        if any(not 0 <= token < vocab_size for token in tokens):
            raise InvalidRequestError(
                f"sequences[{index}]: a token id is outside [0, {vocab_size})", param="sequences"
            )
        blocks = -(-len(tokens) // block_size)
        tables.append((0, len(tokens), list(range(next_block, next_block + blocks))))
        next_block += blocks
        starts.append(len(ids))
        ids.extend(tokens)
        positions.extend(range(len(tokens)))
    return PackedBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        meta=AttentionMetadata.build(tables, block_size),
        num_blocks=next_block,
        starts=tuple(starts),
        lengths=tuple(len(sequence) for sequence in sequences),
    )


def unpad(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[list[list[int]], list[int]]:
    """Rows of a padded batch input_ids [B, L] with attention_mask [B, L] (1 = token, 0 = padding; each
    row's tokens one contiguous run: left or right padding) -> (each row's tokens, its first column)."""
    if input_ids.dim() != 2:
        raise InvalidRequestError("input_ids: expected [batch, length]", param="input_ids")
    if attention_mask is None:
        return [row.tolist() for row in input_ids], [0] * input_ids.shape[0]
    if attention_mask.shape != input_ids.shape:
        raise InvalidRequestError("attention_mask: must have the shape of input_ids", param="attention_mask")
    rows: list[list[int]] = []
    firsts: list[int] = []
    for index, (row, mask) in enumerate(zip(input_ids.tolist(), attention_mask.tolist(), strict=True)):
        columns = [column for column, keep in enumerate(mask) if keep]
        if not columns or columns[-1] - columns[0] + 1 != len(columns):
            raise InvalidRequestError(
                f"attention_mask[{index}]: the tokens must be one contiguous run (left or right padding)",
                param="attention_mask",
            )
        rows.append([row[column] for column in columns])
        firsts.append(columns[0])
    return rows, firsts
