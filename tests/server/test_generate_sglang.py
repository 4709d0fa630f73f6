"""SGLang's /generate as SGLang's clients use it: logprob fields in SGLang's shapes, logprob_start_len,
top_logprobs_num, return_text_in_logprobs, input_ids, batches with per-prompt values, streaming, full
float precision, and the p_vs_d identity (decoded logprobs == the same tokens' prompt logprobs, bitwise),
with its negative control on plain ops."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from deterministic_inference.server.app import ServerSettings
from tests.server.harness import TINY_NAME, RunningServer, thread_server, tiny_config
from tests.tiny_models import TinyModel

GREEDY = {"temperature": 0.0, "max_new_tokens": 6}


def bits(value: float) -> int:
    """The float32 bits of a JSON logprob (raises if it is not exactly a float32)."""
    packed = struct.unpack("<I", struct.pack("<f", value))[0]
    assert struct.unpack("<f", struct.pack("<I", packed))[0] == value, "not a float32 value"
    return packed


def post(server: RunningServer, body: dict[str, Any]) -> Any:
    response = httpx.post(server.base_url + "/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def p_vs_d(server: RunningServer, prompts: list[str], max_new_tokens: int = 8) -> list[bool]:
    """SGLang's p_vs_d check: generate with input logprobs from position 0, send prompt + output back as
    input_ids, compare (token id, logprob bits) of every position."""
    extra = {"return_logprob": True, "logprob_start_len": 0, "return_text_in_logprobs": True}
    first = post(server, {"text": prompts, "sampling_params": {**GREEDY, "max_new_tokens": max_new_tokens},
                          **extra})
    io = [item["meta_info"]["input_token_logprobs"] + item["meta_info"]["output_token_logprobs"]
          for item in first]
    second = post(server, {"input_ids": [[entry[1] for entry in seq] for seq in io],
                           "sampling_params": {**GREEDY, "max_new_tokens": 1}, **extra})
    same = []
    for seq, item in zip(io, second, strict=True):
        scored = item["meta_info"]["input_token_logprobs"]
        same.append([(e[1], None if e[0] is None else bits(e[0])) for e in seq]
                    == [(e[1], None if e[0] is None else bits(e[0])) for e in scored])
    return same


@pytest.fixture(scope="module")
def plain_server(tiny_llama_dir: TinyModel) -> Iterator[RunningServer]:
    """The same server with batch-invariant ops off (negative controls)."""
    config = tiny_config(tiny_llama_dir, batch_invariant=False, selfcheck=False)
    with thread_server(config, ServerSettings(served_model_name=TINY_NAME)) as server:
        yield server


def test_logprob_fields_have_sglang_shapes(tiny_server: RunningServer) -> None:
    ids = [0, 40, 41, 42, 43]
    item = post(tiny_server, {"input_ids": ids, "sampling_params": GREEDY, "return_logprob": True,
                              "logprob_start_len": 2, "top_logprobs_num": 3, "return_text_in_logprobs": True})
    meta = item["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == ids[2:]
    assert meta["input_token_logprobs"][0][0] is None and all(isinstance(e[0], float)
                                                              for e in meta["input_token_logprobs"][1:])
    assert meta["input_top_logprobs"][0] is None and all(len(p) == 3 for p in meta["input_top_logprobs"][1:])
    assert [e[1] for e in meta["output_token_logprobs"]] == item["output_ids"]
    assert meta["output_token_logprobs_length"] == len(item["output_ids"]) == 6
    assert all(len(p) == 3 and all(len(e) == 3 for e in p) for p in meta["output_top_logprobs"])
    assert all(isinstance(e[2], str) for e in meta["output_token_logprobs"])  # return_text_in_logprobs
    assert "".join(e[2] for e in meta["output_token_logprobs"]) == item["text"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    # default logprob_start_len (-1): output logprobs only; no top keys without top_logprobs_num; no text
    plain = post(tiny_server, {"input_ids": ids, "sampling_params": GREEDY, "return_logprob": True})
    plain = plain["meta_info"]
    assert plain["input_token_logprobs"] == [] and "output_top_logprobs" not in plain
    assert [e[0] for e in plain["output_token_logprobs"]] == [e[0] for e in meta["output_token_logprobs"]]
    assert all(e[2] is None for e in plain["output_token_logprobs"])
    without = post(tiny_server, {"input_ids": ids, "sampling_params": GREEDY})["meta_info"]
    assert "output_token_logprobs" not in without and "input_token_logprobs" not in without


def test_batches_take_per_prompt_values_and_match_single_requests(tiny_server: RunningServer) -> None:
    body = {"text": ["Hello, world", "The quick brown fox"], "sampling_params": [GREEDY, {**GREEDY, "n": 2}],
            "return_logprob": [True, False], "logprob_start_len": [0, -1], "top_logprobs_num": 1}
    items = post(tiny_server, body)
    assert [item["index"] for item in items] == [0, 1, 2]
    assert "input_token_logprobs" in items[0]["meta_info"]
    assert "output_token_logprobs" not in items[1]["meta_info"]
    alone = post(tiny_server, {"text": "Hello, world", "sampling_params": GREEDY, "return_logprob": True,
                               "logprob_start_len": 0, "top_logprobs_num": 1})
    assert {**alone["meta_info"], "id": None} == {**items[0]["meta_info"], "id": None}
    assert alone["output_ids"] == items[0]["output_ids"]


def test_stream_ends_with_the_full_response(tiny_server: RunningServer) -> None:
    body = {"text": "Numbers 0123", "sampling_params": GREEDY, "return_logprob": True, "logprob_start_len": 1,
            "top_logprobs_num": 2}
    whole = post(tiny_server, body)
    url = tiny_server.base_url + "/generate"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 2
    last = json.loads(events[-2])
    assert {**last["meta_info"], "id": None} == {**whole["meta_info"], "id": None}
    assert last["text"] == whole["text"]


def test_p_vs_d_decoded_logprobs_equal_prompt_logprobs(tiny_server: RunningServer) -> None:
    assert p_vs_d(tiny_server, ["Hello, world", "def add(a, b):", "Bitwise reproducible"]) == [True] * 3


def test_p_vs_d_negative_control_plain_ops_differ(plain_server: RunningServer) -> None:
    prompts = ["Hello, world", "def add(a, b):", "Bitwise reproducible", "The quick brown fox jumps"]
    same = p_vs_d(plain_server, prompts, max_new_tokens=16)
    assert not all(same), "plain ops matched: the test cannot fail"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input_ids": [0, 40], "return_logprob": True, "logprob_start_len": 3}, "logprob_start_len"),
        ({"input_ids": [0, 40], "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
        ({"text": ["a", "b"], "return_logprob": [True]}, "return_logprob"),
        ({"text": ["a", "b"], "sampling_params": [{}, {}, {}]}, "sampling_params"),
        ({"text": "a", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
        ({"text": "a", "token_ids_logprob": [1, 2]}, "token_ids_logprob"),
    ],
)
def test_bad_logprob_requests_are_400_naming_the_field(tiny_server: RunningServer, body: dict[str, Any],
                                                       field: str) -> None:
    response = httpx.post(tiny_server.base_url + "/generate", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
