"""Shared pieces of the op-level invariance tests: shapes, raw-bit comparison, thread control, row probes."""

from __future__ import annotations

from collections.abc import Callable

import torch

from deterministic_inference.ops.selfcheck import torch_threads

# SmolLM2-135M
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 576, 1536, 9, 3, 64, 49152
# the tiny test models (tests/tiny_models.py)
TINY_HIDDEN, TINY_INTER, TINY_HEADS, TINY_KV_HEADS, TINY_HEAD_DIM = 64, 128, 4, 2, 16

THREADS = (1, 2)
DTYPES = (torch.float32, torch.bfloat16)
BATCH_SIZES = (1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 31, 33, 64)  # a sample of 1..64 around T=4 and T=8
RowFn = Callable[[torch.Tensor], torch.Tensor]


def bits(x: torch.Tensor) -> torch.Tensor:
    """Raw bits of a float tensor: -0.0 and +0.0 differ, unlike torch.equal on the values."""
    x = x.contiguous()
    return x.view(torch.int16) if x.element_size() == 2 else x.view(torch.int32)


num_threads = torch_threads  # one implementation: the self-check's


def row_mismatches(
    fn: RowFn,
    rows: torch.Tensor,  # [R, K] probe rows
    threads: int,
    sizes: tuple[int, ...] = BATCH_SIZES,
    seed: int = 0,
) -> list[str]:
    """Each probe row computed alone with ONE thread vs inside a random batch of every size, probe rows at
    the first, a middle and the last position, with `threads` threads. Returns the mismatches found."""
    generator = torch.Generator().manual_seed(seed)
    with num_threads(1):
        references = [bits(fn(rows[i : i + 1]))[0] for i in range(rows.shape[0])]
    found: list[str] = []
    with num_threads(threads):
        for size in sizes:
            batch = torch.randn(size, rows.shape[1], generator=generator).to(rows.dtype)
            placed = {
                position: (size + k) % rows.shape[0] for k, position in enumerate((0, size // 2, size - 1))
            }
            for position, row in placed.items():
                batch[position] = rows[row]
            out = bits(fn(batch))
            found.extend(
                f"M={size} position={position}"
                for position, row in placed.items()
                if not torch.equal(out[position], references[row])
            )
    return found
