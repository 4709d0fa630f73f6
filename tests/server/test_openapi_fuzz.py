"""API fuzzing with schemathesis against the schema a real `detinf serve` publishes at /openapi.json.

For every operation, schemathesis generates bodies that follow the schema (positive) and bodies that
break it (negative); a bounded number of each is sent to the server over loopback. Every answer must be
no server error (5xx), have a documented status and content type, and conform to the published
response schema. Examples are derandomized, so a CI run replays the same requests.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.result import Err

from tests.server.harness import RunningServer, subprocess_server, tiny_serve_args
from tests.tiny_models import TinyModel

EXAMPLES = 30  # per operation and generation mode
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama_dir: TinyModel) -> Iterator[RunningServer]:
    """`detinf serve` on the tiny model, with a short context so valid requests finish fast."""
    args = tiny_serve_args(tiny_llama_dir, "--max-model-len", "96", "--max-num-seqs", "8", "--threads", "1")
    with subprocess_server(args) as (server, _):
        yield server


def fuzz(operation: Any, mode: GenerationMode, base_url: str) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        response = case.call(base_url=base_url, timeout=60)
        case.validate_response(response, checks=CHECKS)

    run()


def test_every_operation_survives_fuzzing(fuzz_server: RunningServer) -> None:
    schema = schemathesis.openapi.from_url(fuzz_server.base_url + "/openapi.json")
    operations = []
    for result in schema.get_all_operations():
        if isinstance(result, Err):
            raise result.err()  # the served schema has an operation schemathesis cannot read
        operations.append(result.ok())
    names = {f"{op.method.upper()} {op.path}" for op in operations}
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /generate"} <= names
    for operation in operations:
        has_body = bool(list(operation.body))  # without one, there is nothing to break
        modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_body else (GenerationMode.POSITIVE,)
        for mode in modes:
            fuzz(operation, mode, fuzz_server.base_url)
