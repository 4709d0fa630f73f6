"""Determinism-aware routing for the replicated server (plain Python; no Ray).

Which replica answers never changes a response's bits: every replica that is routed to has the
deployment's fingerprint, and for an equal fingerprint the output is a pure function of the request.
Routing only decides *where* work lands:

- **Prefix affinity.** The first `AFFINITY_CHARS` characters of the request's prompt (text, rendered
  chat messages, or token ids) are the affinity key; rendezvous hashing (highest sha256 of key + replica
  name) maps it to one replica, so requests sharing a long prompt prefix meet that replica's prefix
  cache. Removing a replica moves only the keys it owned.
- **Least-loaded fallback.** When the preferred replica has more than `LOAD_SLACK` requests in flight
  beyond the least-loaded one (or the body has no prompt), the least-loaded replica is chosen, ties
  broken by replica index. Nothing here depends on Python's `hash()` or on dict order.
- **Fingerprint check at join.** A replica whose engine fingerprint differs from the deployment's is
  never routed to; `fingerprint_differences` names the parts that differ for /healthz and /metrics.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

AFFINITY_CHARS = 256  # prompt characters that form the affinity key (~64 tokens: several KV blocks)
LOAD_SLACK = 4  # in-flight requests the preferred replica may carry beyond the least-loaded one
FINGERPRINT_PARTS = ("model", "numerics", "software", "hardware")


def affinity_key(body: bytes) -> str:
    """The affinity key of a request body: the first AFFINITY_CHARS characters of its (first) prompt, or
    "" when the body holds no prompt (it is then routed by load; the replica answers its error)."""
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(document, dict):
        return ""
    text = _prompt_text(document)
    return text[:AFFINITY_CHARS]


def _prompt_text(document: dict[str, Any]) -> str:
    messages = document.get("messages")
    if isinstance(messages, list):
        return "\x1e".join(_message_text(message) for message in messages)
    for field in ("prompt", "text", "input_ids"):
        if field in document:
            return _first_prompt(document[field])
    return ""


def _message_text(message: Any) -> str:
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, list):  # content parts: their text, in order
        content = "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return f"{message.get('role', '')}\x1f{content if isinstance(content, str) else ''}"


def _first_prompt(value: Any) -> str:
    """Text of a prompt given as a string, a list of strings, token ids, or a list of token-id lists."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        first = value[0]
        if isinstance(first, str | list):
            return _first_prompt(first)
        return "ids:" + ",".join(str(item) for item in value)
    return ""


def rendezvous_score(key: str, replica: str) -> int:
    """sha256-based score of (key, replica); the highest-scoring replica owns the key."""
    digest = hashlib.sha256(f"{key}\x00{replica}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def choose_replica(key: str, loads: Mapping[str, int], order: Sequence[str]) -> str | None:
    """The replica for a request with affinity `key`, among the routable replicas `order` (index order)
    with their in-flight counts `loads`; None when no replica is routable."""
    if not order:
        return None
    least = min(order, key=lambda name: (loads.get(name, 0), order.index(name)))
    if not key:
        return least
    preferred = max(order, key=lambda name: (rendezvous_score(key, name), name))
    if loads.get(preferred, 0) <= loads.get(least, 0) + LOAD_SLACK:
        return preferred
    return least


def fingerprint_differences(reference: Mapping[str, Any], other: Mapping[str, Any]) -> list[str]:
    """Parts in which two engine fingerprints differ (numerics down to the setting), e.g.
    ``["numerics.dtype: bfloat16 != float32", "hardware"]``; empty when equal."""
    differences: list[str] = []
    for part in FINGERPRINT_PARTS:
        want, got = reference.get(part), other.get(part)
        if want == got:
            continue
        if isinstance(want, dict) and isinstance(got, dict):
            for name in sorted(set(want) | set(got)):
                if want.get(name) != got.get(name):
                    differences.append(f"{part}.{name}: {_short(want.get(name))} != {_short(got.get(name))}")
        else:
            differences.append(f"{part}: {_short(want)} != {_short(got)}")
    return differences


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return text if len(text) <= 48 else text[:45] + "..."
