"""What a run records besides tokens: logits, activations and the engine trace.

File formats (all JSON written with sorted keys; floats are the float64 repr of float32 values, which
round-trips the float32 bits exactly):

- ``captures/logits.json``: ``{"dtype": "float32", "top_k": K, "sequences": [{"request_id", "index",
  "token_logprobs": [float per output step], "top_logprobs": [[[token_id, float], ...] per step]}]}``.
- ``captures/activations.json``: ``{"layers": L + 1, "digest": "sha256 of each row's raw bytes",
  "sequences": [{"sequence_id", "positions": [int], "digests": [[hex per layer] per position]}]}``.
  Layer L is the final norm output. A row is keyed by its token position, so it does not depend on how
  the scheduler cut prompts into chunks; positions served from the prefix cache are absent.
- ``captures/activations.safetensors`` (on request): ``"<sequence_id>/layer<NN>"`` -> [positions, hidden].
- ``captures/engine_trace.json``: ``{"steps": [{"step_id", "num_batched_tokens", "preempted_ids",
  "chunks": [{"request_id", "num_tokens", "start_position", "num_cached_tokens", "sample",
  "all_logits", "block_ids"}]}]}``; a block id of -1 was released behind an all-layer sliding window.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from deterministic_inference.engine.plan import StepPlan


class ActivationRecorder:
    """A layer hook that digests every hidden-state row per (sequence, step, layer)."""

    def __init__(self, keep_tensors: bool = False) -> None:
        self.keep_tensors = keep_tensors
        # (step_id, sequence_id) -> per layer: row digests, and optionally the rows themselves
        self._digests: dict[tuple[int, str], dict[int, list[str]]] = {}
        self._tensors: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
        self.num_layers = 0

    def __call__(self, step_id: int, layer_index: int, request_ids: list[str], rows_per_request: list[int],
                 hidden: torch.Tensor) -> None:
        """Engine layer hook: hidden is [sum(rows_per_request), hidden_size] in request order."""
        self.num_layers = max(self.num_layers, layer_index + 1)
        raw = hidden.detach().contiguous()
        start = 0
        for sequence_id, rows in zip(request_ids, rows_per_request, strict=True):
            block = raw[start:start + rows]
            start += rows
            data = block.view(torch.uint8).numpy()  # [rows, hidden * element size]
            digests = [hashlib.sha256(row.tobytes()).hexdigest() for row in data]
            self._digests.setdefault((step_id, sequence_id), {})[layer_index] = digests
            if self.keep_tensors:
                self._tensors.setdefault((step_id, sequence_id), {})[layer_index] = block.clone()

    def document(self, trace: list[StepPlan]) -> dict[str, Any]:
        """The activations.json document, rows placed at their token positions using the trace."""
        by_sequence: dict[str, dict[int, list[str]]] = {}
        for plan in trace:
            for chunk in plan.chunks:
                layers = self._digests.get((plan.step_id, chunk.request_id))
                if not layers:
                    continue
                positions = by_sequence.setdefault(chunk.request_id, {})
                for row in range(len(chunk.token_ids)):
                    positions[chunk.start_position + row] = [layers[k][row] for k in sorted(layers)]
        sequences = []
        for sequence_id in sorted(by_sequence):
            rows = by_sequence[sequence_id]
            ordered = sorted(rows)
            sequences.append({"sequence_id": sequence_id, "positions": ordered,
                              "digests": [rows[p] for p in ordered]})
        return {"layers": self.num_layers, "digest": "sha256 of each row's raw bytes", "sequences": sequences}

    def tensors(self, trace: list[StepPlan]) -> dict[str, torch.Tensor]:
        """Full hidden states per (sequence, layer): rows in position order."""
        pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for plan in trace:
            for chunk in plan.chunks:
                layers = self._tensors.get((plan.step_id, chunk.request_id), {})
                for layer, block in layers.items():
                    key = f"{chunk.request_id}/layer{layer:02d}"
                    pieces.setdefault(key, []).append((chunk.start_position, block))
        result = {}
        for key in sorted(pieces):
            ordered = sorted(pieces[key], key=lambda item: item[0])
            result[key] = torch.cat([block for _, block in ordered]).contiguous()
        return result


def trace_document(trace: list[StepPlan]) -> dict[str, Any]:
    """The engine_trace.json document of a list of step plans."""
    steps = []
    for plan in trace:
        steps.append({
            "step_id": plan.step_id,
            "num_batched_tokens": plan.num_batched_tokens,
            "preempted_ids": list(plan.preempted_ids),
            "chunks": [
                {"request_id": chunk.request_id, "num_tokens": len(chunk.token_ids),
                 "start_position": chunk.start_position, "num_cached_tokens": chunk.num_cached_tokens,
                 "sample": chunk.sample, "all_logits": chunk.all_logits, "block_ids": list(chunk.block_ids)}
                for chunk in plan.chunks
            ],
        })
    return {"steps": steps}


def logits_document(sequences: list[dict[str, Any]], top_k: int) -> dict[str, Any]:
    """The logits.json document from the run's sequences (as in tokens.json plus logprobs)."""
    return {
        "dtype": "float32",
        "top_k": top_k,
        "sequences": [
            {"request_id": item["request_id"], "index": item["index"],
             "token_logprobs": item["token_logprobs"], "top_logprobs": item["top_logprobs"]}
            for item in sequences
        ],
    }


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """Full activation tensors as safetensors bytes (keys sorted by the format, fixed metadata)."""
    from safetensors.torch import save

    data: bytes = save(tensors, metadata={"format": "pt"})
    return data
