"""Routing decisions of the replicated server (pure functions) and the merged /metrics text."""

from __future__ import annotations

import json

from deterministic_inference.scaleout import routing
from deterministic_inference.scaleout.metrics_merge import merge_expositions, relabel

NAMES = ["replica-0", "replica-1", "replica-2"]


def _body(document: object) -> bytes:
    return json.dumps(document).encode()


def test_affinity_key_reads_every_prompt_form() -> None:
    long_prefix = "shared context " * 40  # 600 characters
    assert routing.affinity_key(_body({"prompt": long_prefix + "A"})) == long_prefix[: routing.AFFINITY_CHARS]
    assert routing.affinity_key(_body({"prompt": ["first", "second"]})) == "first"
    assert routing.affinity_key(_body({"prompt": [5, 6, 7]})) == "ids:5,6,7"
    assert routing.affinity_key(_body({"prompt": [[5, 6], [7]]})) == "ids:5,6"
    assert routing.affinity_key(_body({"text": "hi"})) == "hi"
    assert routing.affinity_key(_body({"input_ids": [1, 2]})) == "ids:1,2"
    chat = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hello"}]}]}
    assert routing.affinity_key(_body(chat)) == "system\x1fbe brief\x1euser\x1fhello"
    for bad in (b"not json", b"[1, 2]", _body({"model": "x"}), b"\xff\xfe"):
        assert routing.affinity_key(bad) == ""


def test_same_prefix_same_replica_and_keys_spread() -> None:
    prefix = "shared context " * 40
    idle = dict.fromkeys(NAMES, 0)
    chosen = {routing.choose_replica(routing.affinity_key(_body({"prompt": prefix + str(i)})), idle, NAMES)
              for i in range(20)}
    assert len(chosen) == 1  # a long shared prefix: one replica, whose prefix cache holds it
    spread = {routing.choose_replica(f"prompt {i}", idle, NAMES) for i in range(40)}
    assert spread == set(NAMES)  # distinct prompts use every replica


def test_least_loaded_fallback_and_no_replica() -> None:
    key = "some prompt"
    preferred = routing.choose_replica(key, dict.fromkeys(NAMES, 0), NAMES)
    assert preferred is not None
    loads = dict.fromkeys(NAMES, 0)
    loads[preferred] = routing.LOAD_SLACK  # within the slack: affinity wins
    assert routing.choose_replica(key, loads, NAMES) == preferred
    loads[preferred] = routing.LOAD_SLACK + 1  # past it: the least loaded, lowest index first
    assert routing.choose_replica(key, loads, NAMES) == next(n for n in NAMES if n != preferred)
    assert routing.choose_replica("", {"replica-0": 3, "replica-1": 1, "replica-2": 1}, NAMES) == "replica-1"
    assert routing.choose_replica(key, {}, []) is None


def test_removing_a_replica_moves_only_its_keys() -> None:
    keys = [f"prompt {i}" for i in range(60)]
    idle = dict.fromkeys(NAMES, 0)
    before = {key: routing.choose_replica(key, idle, NAMES) for key in keys}
    after = {key: routing.choose_replica(key, idle, NAMES[:2]) for key in keys}
    moved = [key for key in keys if before[key] != after[key]]
    assert moved and all(before[key] == "replica-2" for key in moved)


def test_fingerprint_differences_name_the_part() -> None:
    base = {"model": "sha256:a", "numerics": {"dtype": "bfloat16", "kv_block_size": 16},
            "software": "sha256:s", "hardware": "sha256:h"}
    assert routing.fingerprint_differences(base, dict(base)) == []
    other = {**base, "numerics": {"dtype": "float32", "kv_block_size": 16}, "hardware": "sha256:x"}
    assert routing.fingerprint_differences(base, other) == [
        "numerics.dtype: bfloat16 != float32", "hardware: sha256:h != sha256:x"]


def test_metrics_merge_labels_every_sample_once_per_family() -> None:
    text = ("# HELP detinf_requests_total HTTP requests\n# TYPE detinf_requests_total counter\n"
            'detinf_requests_total{path="/v1/completions",status="200"} 3\n'
            "# HELP detinf_ready ready\n# TYPE detinf_ready gauge\ndetinf_ready 1\n")
    merged = merge_expositions([("replica-0", text), ("replica-1", text.replace(" 3\n", " 5\n"))])
    lines = merged.splitlines()
    assert lines.count("# TYPE detinf_requests_total counter") == 1
    assert 'detinf_requests_total{replica="replica-0",path="/v1/completions",status="200"} 3' in lines
    assert 'detinf_requests_total{replica="replica-1",path="/v1/completions",status="200"} 5' in lines
    assert 'detinf_ready{replica="replica-1"} 1' in lines
    assert relabel('x_bucket{le="+Inf"} 2', 'a"b') == 'x_bucket{replica="a\\"b",le="+Inf"} 2'
