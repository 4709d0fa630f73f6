"""A JSON eval through the workflow: dataset records carrying `response_format` run through `detinf run`
twice, every answer valid under its schema, and `verify` grades the two runs conformant; records with
tools become the tool-call grammar, and malformed constraint fields are one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from deterministic_inference.errors import WorkflowError
from deterministic_inference.workflow.constraints import check_record, request_constraint
from deterministic_inference.workflow.rundir import load_run_dir
from tests.workflow.helpers import detinf, edit_manifest

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "score"],
    "additionalProperties": False,
}
LOOKUP = {"type": "object", "properties": {"q": {"enum": ["a", "b"]}}, "required": ["q"]}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": LOOKUP}}


def json_eval(path: Path) -> Path:
    records = [
        {"id": "j1", "prompt": "Is water wet?",
         "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
        {"id": "j2", "prompt": "Any JSON object, please.", "response_format": {"type": "json_object"}},
        {"id": "p1", "prompt": "Free text."},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def configure(manifest: Path) -> None:
    json_eval(manifest.with_name("eval.jsonl"))
    edit_manifest(manifest, {"inference": {
        "n_prompts": 3, "dataset": {"source": "eval.jsonl", "digest": "sha256:unset"},
        "request_template": {"kind": "chat", "sampling": {"max_tokens": 40, "temperature": 1.0, "seed": 5}},
    }})  # fmt: skip
    assert detinf("digest-bootstrap", "--config", manifest).code == 0
    locked = detinf("lock", "--config", manifest)
    assert locked.code == 0, locked.err


def test_json_eval_runs_twice_conformant_and_valid(tiny_manifest: Path, tmp_path: Path) -> None:
    configure(tiny_manifest)
    for name in ("a", "b"):
        result = detinf("run", "--config", tiny_manifest, "--output-dir", tmp_path / name)
        assert result.code == 0, result.err
    run = load_run_dir(tmp_path / "a")
    texts = {s["request_id"]: s["text"] for s in run.tokens["sequences"]}
    finish = {s["request_id"]: s["finish_reason"] for s in run.tokens["sequences"]}
    assert finish["req-0000"] == "stop"
    jsonschema.validate(json.loads(texts["req-0000"]), SCHEMA)
    assert texts["req-0001"].startswith("{")  # any JSON object: a random model may hit max_tokens in it
    if finish["req-0001"] == "stop":
        assert isinstance(json.loads(texts["req-0001"]), dict)
    requests = run.read_json("requests.json")
    assert requests[0]["response_format"]["type"] == "json_schema"
    verified = detinf("verify", "--bundle-a", tmp_path / "a", "--bundle-b", tmp_path / "b",
                      "--output-dir", tmp_path / "v")  # fmt: skip
    assert verified.code == 0 and verified.out.startswith("grade: conformant"), verified.out


def test_bad_constraint_in_a_record_is_one_line_naming_it(tiny_manifest: Path) -> None:
    path = tiny_manifest.with_name("eval.jsonl")
    configure(tiny_manifest)
    bad = {"id": "bad", "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "b", "schema": {"type": "string", "format": "no-such-format"}}}}  # fmt: skip
    path.write_text(json.dumps(bad) + "\n" + path.read_text(), encoding="utf-8")
    edit_manifest(tiny_manifest, {"inference": {"dataset": {"digest": "sha256:unset"}}})
    assert detinf("digest-bootstrap", "--config", tiny_manifest).code == 0
    assert detinf("lock", "--config", tiny_manifest).code == 0
    result = detinf("run", "--config", tiny_manifest, "--output-dir", tiny_manifest.with_name("bad-run"))
    assert result.code == 2 and "'bad'" in result.err and "no-such-format" in result.err, result.err
    assert len(result.err.strip().splitlines()) == 1
    assert not tiny_manifest.with_name("bad-run").exists()


def test_tools_in_a_record_become_the_tool_call_grammar() -> None:
    record = {"id": "t", "prompt": "x", "tools": [TOOL], "tool_choice": "required"}
    spec = request_constraint(record)
    assert spec is not None and spec.kind == "lark" and "lookup" in spec.source
    check_record(record, "eval.jsonl: record 't'", chat=True)
    with pytest.raises(WorkflowError, match="need chat requests"):
        check_record(record, "eval.jsonl: record 't'", chat=False)
    with pytest.raises(WorkflowError, match="record 'u'.*response_format"):
        check_record({"id": "u", "prompt": "x", "response_format": {"type": "xml"}}, "record 'u'", chat=True)
