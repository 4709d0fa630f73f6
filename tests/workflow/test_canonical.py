"""Canonical JSON and content ids: golden vectors (RFC 8785 number/string forms, frozen digests)."""

from __future__ import annotations

import hashlib
import struct

import pytest

from deterministic_inference.errors import WorkflowError
from deterministic_inference.workflow import canonical

# IEEE-754 bit patterns and their ECMAScript / RFC 8785 text (RFC 8785, appendix B).
NUMBER_VECTORS = [
    ("0000000000000000", "0"),
    ("8000000000000000", "0"),
    ("0000000000000001", "5e-324"),
    ("8000000000000001", "-5e-324"),
    ("7fefffffffffffff", "1.7976931348623157e+308"),
    ("ffefffffffffffff", "-1.7976931348623157e+308"),
    ("4340000000000000", "9007199254740992"),
    ("c340000000000000", "-9007199254740992"),
    ("4430000000000000", "295147905179352830000"),
    ("44b52d02c7e14af5", "9.999999999999997e+22"),
    ("44b52d02c7e14af6", "1e+23"),
    ("44b52d02c7e14af7", "1.0000000000000001e+23"),
    ("444b1ae4d6e2ef4e", "999999999999999700000"),
    ("444b1ae4d6e2ef4f", "999999999999999900000"),
    ("444b1ae4d6e2ef50", "1e+21"),
    ("3eb0c6f7a0b5ed8c", "9.999999999999997e-7"),
    ("3eb0c6f7a0b5ed8d", "0.000001"),
    ("41b3de4355555553", "333333333.3333332"),
    ("41b3de4355555554", "333333333.33333325"),
    ("41b3de4355555555", "333333333.3333333"),
    ("41b3de4355555556", "333333333.3333334"),
    ("41b3de4355555557", "333333333.33333343"),
    ("becbf647612f3696", "-0.0000033333333333333333"),
    ("43143ff3c1cb0959", "1424953923781206.2"),
]


@pytest.mark.parametrize(("bits", "text"), NUMBER_VECTORS)
def test_number_form(bits: str, text: str) -> None:
    value = struct.unpack(">d", bytes.fromhex(bits))[0]
    assert canonical.canonical_json(value) == text


def test_rfc8785_sample_object() -> None:
    document = {
        "numbers": [333333333.33333329, 1e30, 4.50, 2e-3, 0.000000000000000000000000001],
        "string": "\u20ac$\u000f\nA'B\"\\\\\"/",
        "literals": [None, True, False],
    }
    expected = (
        '{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],'
        '"string":"\u20ac$\\u000f\\nA\'B\\"\\\\\\\\\\"/"}'
    )
    assert canonical.canonical_json(document) == expected


def test_keys_sorted_by_code_point_and_utf8() -> None:
    text = canonical.canonical_json({"b": 1, "a": {"z": [], "é": "ü", "Z": 2.0}, "\u00e0": True})
    assert text == '{"a":{"Z":2,"z":[],"é":"ü"},"b":1,"à":true}'
    assert canonical.canonical_bytes({"é": 1}) == '{"é":1}'.encode()


def test_big_integers_are_exact_and_int_float_agree() -> None:
    assert canonical.canonical_json(2**63 - 1) == "9223372036854775807"
    assert canonical.canonical_json([1, 1.0, -0.0]) == "[1,1,0]"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), {1: "x"}, {"a": {1, 2}}, b"x"])
def test_values_without_a_json_form_are_refused(bad: object) -> None:
    with pytest.raises(WorkflowError):
        canonical.canonical_json(bad)


def test_manifest_and_lock_id_vectors() -> None:
    assert canonical.manifest_id({"a": 1}) == (
        "sha256:015abd7f5cc57a2dd94b7590f04ad8084273905ee33ec5cebeae62276a97f862"
    )
    assert canonical.manifest_id({"b": [1, 2.5, "x"], "a": None}) == (
        "sha256:" + hashlib.sha256(b'{"a":null,"b":[1,2.5,"x"]}').hexdigest()
    )
    lock = {"kind": "detinf.lock", "x": 1, "lock_id": "anything"}
    expected = "sha256:021d3628b6a993edb730570b08e8e0931464406059b775d6c96032ac55b527e9"
    assert canonical.lock_id(lock) == expected
    assert canonical.lock_id(lock) == canonical.lock_id({"x": 1, "kind": "detinf.lock"})


def test_run_id_vector() -> None:
    parts = ["sha256:" + digit * 64 for digit in "0123"]
    expected = "sha256:d7291aed5f0d1ca5f20ba1f607572760b56d53773163e6f898ca4160ca90379a"
    assert canonical.run_id(*parts) == expected
    assert expected == "sha256:" + hashlib.sha256("".join(parts).encode()).hexdigest()
    with pytest.raises(WorkflowError, match="requests_digest"):
        canonical.run_id(parts[0], parts[1], "sha256:XYZ", parts[3])


def test_strict_loading_refuses_duplicates_and_nan() -> None:
    with pytest.raises(WorkflowError, match="duplicate key 'a'"):
        canonical.loads_strict('{"a": 1, "a": 2}', "x.json")
    with pytest.raises(WorkflowError, match="NaN"):
        canonical.loads_strict('{"a": NaN}', "x.json")
    with pytest.raises(WorkflowError, match="line 1 column"):
        canonical.loads_strict('{"a": }', "x.json")
