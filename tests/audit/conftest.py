"""Fixtures: tiny-model servers with batch invariance on (the product) and off (negative control)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from deterministic_inference.server.app import ServerSettings
from tests.server.harness import TINY_NAME, RunningServer, thread_server, tiny_config
from tests.tiny_models import TinyModel


@pytest.fixture(scope="module")
def invariant_server(tiny_llama_dir: TinyModel) -> Iterator[RunningServer]:
    with thread_server(tiny_config(tiny_llama_dir), ServerSettings(served_model_name=TINY_NAME)) as server:
        yield server


@pytest.fixture(scope="module")
def plain_server(tiny_llama_dir: TinyModel) -> Iterator[RunningServer]:
    """`--no-batch-invariant`: plain torch ops."""
    config = tiny_config(tiny_llama_dir, batch_invariant=False)
    with thread_server(config, ServerSettings(served_model_name=TINY_NAME)) as server:
        yield server
