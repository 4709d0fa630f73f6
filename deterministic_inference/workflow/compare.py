"""Output comparisons between two runs: tokens, logits (bits and ULPs), activations, engine trace.

Sequences are matched by (request_id, choice index). Each comparison returns a JSON-ready dict with
``equal`` and the first place the runs differ. Logits are compared only where both runs had the same
context: at every step up to and including a sequence's first divergent token (the chosen-token logprob
only where both chose the same token; top-k alternatives by token id). ULP distance is measured between
the float32 values (sign-magnitude bits mapped to an ordered integer line, so -0.0 and +0.0 are 0 ULP
apart but not bit-equal).
"""

from __future__ import annotations

import struct
from typing import Any

ULP_BUCKETS = ((0, "0"), (1, "1"), (4, "2-4"), (16, "5-16"), (256, "17-256"))


def float32_key(value: float) -> int:
    """Position of a float32 on an ordered integer line (adjacent floats differ by 1)."""
    (bits,) = struct.unpack("<I", struct.pack("<f", value))
    return -(bits & 0x7FFFFFFF) if bits & 0x80000000 else bits


def float32_bits(value: float) -> int:
    """Raw float32 bits of a value."""
    (bits,) = struct.unpack("<I", struct.pack("<f", value))
    return int(bits)


def ulp_distance(a: float, b: float) -> int:
    """ULPs between two float32 values."""
    return abs(float32_key(a) - float32_key(b))


def _by_key(sequences: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(item["request_id"], int(item["index"])): item for item in sequences}


def sample_steps(trace: dict[str, Any] | None) -> dict[str, list[int]]:
    """Per sequence id, the engine step ids at which it sampled each output token."""
    steps: dict[str, list[int]] = {}
    for step in (trace or {}).get("steps", []):
        for chunk in step["chunks"]:
            if chunk["sample"]:
                steps.setdefault(chunk["request_id"], []).append(step["step_id"])
    return steps


def compare_tokens(a: list[dict[str, Any]], b: list[dict[str, Any]], trace_a: dict[str, Any] | None,
                   trace_b: dict[str, Any] | None) -> dict[str, Any]:
    """Token-level comparison: counts and the first divergent request, step and token."""
    left, right = _by_key(a), _by_key(b)
    keys = sorted(set(left) | set(right))
    mismatched = [key for key in keys if _sequence_differs(left.get(key), right.get(key))]
    result: dict[str, Any] = {"equal": not mismatched, "compared_sequences": len(keys),
                              "mismatched_sequences": len(mismatched), "first_divergence": None}
    if mismatched:
        key = mismatched[0]
        result["first_divergence"] = _divergence(key, left.get(key), right.get(key), trace_a, trace_b)
    return result


def _sequence_differs(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    if a is None or b is None:
        return True
    fields = ("prompt_token_ids", "output_token_ids", "output_tokens", "text", "finish_reason")
    return any(a.get(name) != b.get(name) for name in fields)


def _divergence(key: tuple[str, int], a: dict[str, Any] | None, b: dict[str, Any] | None,
                trace_a: dict[str, Any] | None, trace_b: dict[str, Any] | None) -> dict[str, Any]:
    request_id, index = key
    found: dict[str, Any] = {"request_id": request_id, "index": index}
    if a is None or b is None:
        found.update(step=None, reason="sequence present in only one run: " + ("b" if a is None else "a"))
        return found
    if a.get("prompt_token_ids") != b.get("prompt_token_ids"):
        found.update(step=None, reason="prompt token ids differ")
        return found
    out_a, out_b = a.get("output_token_ids") or [], b.get("output_token_ids") or []
    if not out_a and not out_b:
        out_a, out_b = a.get("output_tokens") or [], b.get("output_tokens") or []
    step = next((k for k, (x, y) in enumerate(zip(out_a, out_b, strict=False)) if x != y), None)
    if step is None and len(out_a) != len(out_b):
        step = min(len(out_a), len(out_b))
    if step is None:
        found.update(step=None, reason="same tokens; text or finish_reason differ",
                     finish_reason_a=a.get("finish_reason"), finish_reason_b=b.get("finish_reason"))
        return found
    sequence_id = f"{request_id}-{index}"
    steps_a, steps_b = sample_steps(trace_a).get(sequence_id, []), sample_steps(trace_b).get(sequence_id, [])
    found.update(
        step=step, reason="output tokens differ",
        token_a=out_a[step] if step < len(out_a) else None,
        token_b=out_b[step] if step < len(out_b) else None,
        engine_step_a=steps_a[step] if step < len(steps_a) else None,
        engine_step_b=steps_b[step] if step < len(steps_b) else None,
    )
    return found


def compare_logits(tokens_a: list[dict[str, Any]], tokens_b: list[dict[str, Any]], logits_a: dict[str, Any],
                   logits_b: dict[str, Any], rule: dict[str, Any]) -> dict[str, Any]:
    """Bitwise / ULP comparison of logprobs over steps with the same context."""
    outputs_a, outputs_b = _by_key(tokens_a), _by_key(tokens_b)
    left, right = _by_key(logits_a["sequences"]), _by_key(logits_b["sequences"])
    stats: dict[str, Any] = {"compared": 0, "bit_equal": 0, "max_ulp": 0, "sum_ulp": 0,
                             "histogram": {label: 0 for _, label in ULP_BUCKETS} | {">256": 0},
                             "first_difference": None}
    for key in sorted(set(left) & set(right) & set(outputs_a) & set(outputs_b)):
        ids_a = _tokens_of(outputs_a[key])
        ids_b = _tokens_of(outputs_b[key])
        last = _shared_context_steps(ids_a, ids_b)
        for step in range(last):
            pairs = _step_pairs(left[key], right[key], step, ids_a, ids_b)
            for what, x, y in pairs:
                _account(stats, key, step, what, x, y)
    compared = stats["compared"]
    stats["mean_ulp"] = stats.pop("sum_ulp") / compared if compared else 0.0
    limit = int(rule.get("max_ulp", 0)) if rule["rule"] == "ulp" else 0
    stats["rule"] = rule["rule"]
    stats["equal"] = stats["max_ulp"] <= limit and (rule["rule"] == "ulp" or stats["bit_equal"] == compared)
    return stats


def _tokens_of(sequence: dict[str, Any]) -> list[Any]:
    """Output token ids, or the token strings when the endpoint returned no ids."""
    return list(sequence.get("output_token_ids") or sequence.get("output_tokens") or [])


def _shared_context_steps(ids_a: list[Any], ids_b: list[Any]) -> int:
    """Number of steps whose context is the same in both runs (up to and including the first divergence)."""
    shortest = min(len(ids_a), len(ids_b))
    for step in range(shortest):
        if ids_a[step] != ids_b[step]:
            return step + 1
    return shortest


def _step_pairs(a: dict[str, Any], b: dict[str, Any], step: int, ids_a: list[Any],
                ids_b: list[Any]) -> list[tuple[str, float, float]]:
    pairs: list[tuple[str, float, float]] = []
    values_a, values_b = a["token_logprobs"], b["token_logprobs"]
    if step < len(values_a) and step < len(values_b) and ids_a[step] == ids_b[step]:
        pairs.append((f"chosen token {ids_a[step]}", values_a[step], values_b[step]))
    tops_a = a["top_logprobs"][step] if step < len(a["top_logprobs"]) else []
    step_b = b["top_logprobs"][step] if step < len(b["top_logprobs"]) else []
    tops_b = {token: value for token, value in step_b}
    for token, value in tops_a:
        if token in tops_b:
            pairs.append((f"top-k token {token}", value, tops_b[token]))
    return pairs


def _account(stats: dict[str, Any], key: tuple[str, int], step: int, what: str, x: float, y: float) -> None:
    stats["compared"] += 1
    if float32_bits(x) == float32_bits(y):
        stats["bit_equal"] += 1
    distance = ulp_distance(x, y)
    stats["sum_ulp"] += distance
    stats["max_ulp"] = max(stats["max_ulp"], distance)
    label = next((name for limit, name in ULP_BUCKETS if distance <= limit), ">256")
    stats["histogram"][label] += 1
    if stats["first_difference"] is None and float32_bits(x) != float32_bits(y):
        stats["first_difference"] = {"request_id": key[0], "index": key[1], "step": step, "value": what,
                                     "a": x, "b": y, "ulp": distance}


def compare_activations(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Row digests per layer: rows compared, rows differing, first divergent (sequence, position, layer)."""
    left = {item["sequence_id"]: item for item in a["sequences"]}
    right = {item["sequence_id"]: item for item in b["sequences"]}
    compared = differing = 0
    first: dict[str, Any] | None = None
    for sequence_id in sorted(set(left) & set(right)):
        rows_b = dict(zip(right[sequence_id]["positions"], right[sequence_id]["digests"], strict=True))
        rows_a = zip(left[sequence_id]["positions"], left[sequence_id]["digests"], strict=True)
        for position, digests in rows_a:
            other = rows_b.get(position)
            if other is None:
                continue
            compared += 1
            layers = [k for k, (x, y) in enumerate(zip(digests, other, strict=False)) if x != y]
            if layers or len(digests) != len(other):
                differing += 1
                if first is None:
                    layer = layers[0] if layers else min(len(digests), len(other))
                    first = {"sequence_id": sequence_id, "position": position, "layer": layer,
                             "layers_differing": len(layers)}
    only = sorted(set(left) ^ set(right))
    return {"equal": differing == 0 and not only, "compared_rows": compared, "differing_rows": differing,
            "sequences_in_one_run_only": only, "first_divergence": first}


def compare_traces(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Step-by-step diff of two engine traces."""
    steps_a, steps_b = a["steps"], b["steps"]
    first = None
    for index in range(max(len(steps_a), len(steps_b))):
        step_a = steps_a[index] if index < len(steps_a) else None
        step_b = steps_b[index] if index < len(steps_b) else None
        if step_a != step_b:
            first = {"index": index, "a": step_a, "b": step_b}
            break
    return {"equal": first is None, "steps_a": len(steps_a), "steps_b": len(steps_b),
            "first_difference": first}
