"""Canonical JSON and the content ids built on it.

Canonical form (the bytes every id and digest of this project hashes):

- **Objects**: members sorted by key, compared as sequences of Unicode code points; keys must be strings
  and unique.
- **Whitespace**: none outside strings; separators are exactly ``,`` and ``:``.
- **Strings**: UTF-8, not ASCII-escaped. Only ``"``, ``\\`` and the control characters U+0000..U+001F are
  escaped: ``\\b \\t \\n \\f \\r`` where they exist, otherwise ``\\u00xx`` with lower-case hex.
- **Literals**: ``true``, ``false``, ``null``.
- **Integers** (JSON numbers without fraction or exponent, Python ``int``): exact decimal digits with an
  optional leading ``-``, whatever their size.
- **Floats**: the ECMAScript ``Number.prototype.toString`` form used by RFC 8785 (JCS): the shortest digit
  string that round-trips the IEEE-754 double; integral values without a fraction (``4.0`` -> ``4``);
  plain notation for decimal exponents in [-6, 21), otherwise ``d.ddde+N`` / ``d.ddde-N``; ``-0.0`` ->
  ``0``. NaN and infinities are refused.

So a float and an int of equal value (``1.0`` and ``1``) have the same canonical form. Ids:

- ``manifest_id = sha256(canonical(manifest))`` of the resolved manifest (inheritance applied);
- ``lock_id = sha256(canonical(lock without "lock_id"))``;
- ``run_id = sha256(manifest_id + lock_id + requests_digest + hardware_fingerprint_digest)`` over the
  UTF-8 of the four ``sha256:<hex>`` strings joined without separator.

Every digest string in this project is ``"sha256:" + 64 lower-case hex digits``.
"""

from __future__ import annotations

import hashlib
import json
import math
from decimal import Decimal
from typing import Any

from deterministic_inference.errors import WorkflowError

DIGEST_PREFIX = "sha256:"
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def canonical_json(value: Any) -> str:
    """The canonical JSON text of `value` (see the module docstring for the exact form)."""
    parts: list[str] = []
    _write(value, parts, "$")
    return "".join(parts)


def canonical_bytes(value: Any) -> bytes:
    """UTF-8 bytes of `canonical_json(value)`."""
    return canonical_json(value).encode("utf-8")


def sha256_hex(data: bytes) -> str:
    """Lower-case hex sha256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def digest_bytes(data: bytes) -> str:
    """``sha256:<hex>`` of raw bytes."""
    return DIGEST_PREFIX + sha256_hex(data)


def digest_json(value: Any) -> str:
    """``sha256:<hex>`` of the canonical JSON of `value`."""
    return digest_bytes(canonical_bytes(value))


# Engine fields added after schema version 1, with their defaults: they count in a manifest's id only when
# they differ from the default, so manifests (and the locks and run directories made for them) from
# before keep their ids.
LATER_ENGINE_DEFAULTS: dict[str, Any] = {
    "kv_cache_memory": None,
    "quantization": "auto",
    "kv_cache_dtype": "auto",
    "numerics": "portable",
}


def manifest_id(manifest: dict[str, Any]) -> str:
    """Id of a resolved manifest (later-added engine fields left out while at their defaults)."""
    engine = manifest.get("engine")
    if isinstance(engine, dict):
        kept = {
            key: value
            for key, value in engine.items()
            if key not in LATER_ENGINE_DEFAULTS or value != LATER_ENGINE_DEFAULTS[key]
        }
        manifest = {**manifest, "engine": kept}
    return digest_json(manifest)


def lock_id(lock: dict[str, Any]) -> str:
    """Id of a lock: the digest of the lock without its own ``lock_id`` field."""
    return digest_json({key: value for key, value in lock.items() if key != "lock_id"})


def run_id(manifest_digest: str, lock_digest: str, requests_digest: str, hardware_digest: str) -> str:
    """Id of a run from the four digests that determine it."""
    for name, value in (("manifest_id", manifest_digest), ("lock_id", lock_digest),
                        ("requests_digest", requests_digest), ("hardware_digest", hardware_digest)):
        check_digest(value, name)
    joined = manifest_digest + lock_digest + requests_digest + hardware_digest
    return digest_bytes(joined.encode("utf-8"))


def is_digest(value: object) -> bool:
    """True for a well-formed ``sha256:<64 hex>`` string."""
    if not isinstance(value, str) or not value.startswith(DIGEST_PREFIX):
        return False
    hex_part = value[len(DIGEST_PREFIX):]
    return len(hex_part) == 64 and all(c in "0123456789abcdef" for c in hex_part)


def check_digest(value: object, where: str) -> str:
    """Return `value` if it is a digest string, else raise naming `where`."""
    if not is_digest(value):
        raise WorkflowError(
            f"{where}: {value!r} is not a digest; expected 'sha256:' + 64 lower-case hex digits"
        )
    return str(value)


def format_float(value: float) -> str:
    """A finite float in the ECMAScript / RFC 8785 number form."""
    if not math.isfinite(value):
        raise WorkflowError(
            f"canonical JSON: {value!r} is not a finite number; NaN and infinities have no JSON form"
        )
    if value == 0:
        return "0"
    if value < 0:
        return "-" + format_float(-value)
    sign, digit_tuple, exponent = Decimal(repr(value)).normalize().as_tuple()
    digits = "".join(str(d) for d in digit_tuple)
    k = len(digits)
    n = int(exponent) + k  # value = 0.digits * 10**n
    if k <= n <= 21:
        return digits + "0" * (n - k)
    if 0 < n <= 21:
        return digits[:n] + "." + digits[n:]
    if -6 < n <= 0:
        return "0." + "0" * (-n) + digits
    e = n - 1
    mantissa = digits if k == 1 else digits[0] + "." + digits[1:]
    return f"{mantissa}e{'+' if e >= 0 else '-'}{abs(e)}"


def _write(value: Any, parts: list[str], path: str) -> None:
    if value is None:
        parts.append("null")
    elif value is True:
        parts.append("true")
    elif value is False:
        parts.append("false")
    elif isinstance(value, int):
        parts.append(str(int(value)))
    elif isinstance(value, float):
        parts.append(format_float(value))
    elif isinstance(value, str):
        parts.append(_string(value))
    elif isinstance(value, dict):
        _write_object(value, parts, path)
    elif isinstance(value, list | tuple):
        parts.append("[")
        for index, item in enumerate(value):
            if index:
                parts.append(",")
            _write(item, parts, f"{path}[{index}]")
        parts.append("]")
    else:
        raise WorkflowError(f"canonical JSON: {path} has a {type(value).__name__}, which has no JSON form")


def _write_object(value: dict[Any, Any], parts: list[str], path: str) -> None:
    for key in value:
        if not isinstance(key, str):
            raise WorkflowError(f"canonical JSON: {path} has a non-string key {key!r}; JSON keys are strings")
    parts.append("{")
    for index, key in enumerate(sorted(value)):
        if index:
            parts.append(",")
        parts.append(_string(key))
        parts.append(":")
        _write(value[key], parts, f"{path}.{key}")
    parts.append("}")


def _string(text: str) -> str:
    out = ['"']
    for char in text:
        if char in _ESCAPES:
            out.append(_ESCAPES[char])
        elif char < " ":
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)


def loads_strict(text: str, where: str) -> Any:
    """Parse JSON text, refusing NaN/Infinity and duplicate keys; errors name `where`."""
    def no_constants(name: str) -> Any:
        raise WorkflowError(f"{where}: {name} is not valid JSON; write a finite number")

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, item in pairs:
            if key in result:
                raise WorkflowError(f"{where}: duplicate key {key!r}; keep one")
            result[key] = item
        return result

    try:
        return json.loads(text, parse_constant=no_constants, object_pairs_hook=unique)
    except json.JSONDecodeError as error:
        raise WorkflowError(
            f"{where}: invalid JSON at line {error.lineno} column {error.colno}: {error.msg}"
        ) from None
