"""Helpers for the scale-out tests: bitwise views of API responses, labelled metrics."""

from __future__ import annotations

import json
import struct
from typing import Any

import httpx

VOLATILE = ("id", "created", "cached_tokens")  # metadata that depends on the request or cache state,
# never part of the output


def bits(value: Any) -> Any:
    """`value` with every float replaced by its float32 bit pattern (hex), and volatile fields dropped: equal
    results mean bitwise-equal logprobs (-0.0 and 0.0 differ here)."""
    if isinstance(value, float):
        return "f32:" + struct.pack("<f", value).hex()
    if isinstance(value, dict):
        return {key: bits(item) for key, item in value.items() if key not in VOLATILE}
    if isinstance(value, list):
        return [bits(item) for item in value]
    return value


def sse_documents(text: str) -> list[Any]:
    """The JSON documents of an SSE body (without the final [DONE])."""
    documents = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            documents.append(json.loads(line[len("data: "):]))
    return documents


def fold_stream(documents: list[Any]) -> dict[str, Any]:
    """A stream's chunks folded per choice (strings concatenated, lists extended): what the stream says,
    independent of where the chunk boundaries fell (they depend on timing, the content does not)."""
    folded: dict[str, Any] = {"choices": {}, "system_fingerprints": sorted(
        {str(doc.get("system_fingerprint")) for doc in documents})}
    for doc in documents:
        for choice in doc.get("choices", []):
            _accumulate(folded["choices"].setdefault(choice["index"], {}), choice)
    return folded


def _accumulate(into: dict[str, Any], piece: dict[str, Any]) -> None:
    for key, value in piece.items():
        if value is None:
            continue
        if isinstance(value, dict):
            _accumulate(into.setdefault(key, {}), value)
        elif isinstance(value, str | list) and key in into and into[key] is not None:
            into[key] = into[key] + value
        else:
            into[key] = value


def labelled_metric(base_url: str, name: str, labels: dict[str, str], headers: dict[str, str] | None = None
                    ) -> float:
    """Value of the sample `name{labels...}` (labels matched as a subset) from GET /metrics; 0 if absent."""
    text = httpx.get(base_url + "/metrics", headers=headers or {}, timeout=30).text
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{key}="{val}"' in head for key, val in labels.items()):
            return float(value)
    return 0.0
