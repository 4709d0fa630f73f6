"""Fixtures: one real uvicorn server on the tiny random Llama, shared by the module's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from deterministic_inference.server.app import ServerSettings
from tests.server.harness import TINY_NAME, RunningServer, thread_server, tiny_config
from tests.tiny_models import TinyModel


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_dir: TinyModel) -> Iterator[RunningServer]:
    """An open (no API key) batch-invariant server on the tiny model."""
    with thread_server(tiny_config(tiny_llama_dir), ServerSettings(served_model_name=TINY_NAME)) as server:
        yield server
