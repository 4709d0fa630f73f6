"""A local Ray instance on loopback (2 CPUs) for the scale-out tests; this test process is its driver.
And the manifest of the sharded runs with its one-process reference run.

Package-scoped: started when the first Ray test needs it and stopped after the package's tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tiny_models import TinyModel
from tests.workflow.helpers import detinf, edit_manifest


@pytest.fixture(scope="package")
def ray_cluster() -> Iterator[str]:
    """The GCS address (127.0.0.1:PORT) of a fresh local Ray instance."""
    import ray

    from deterministic_inference.scaleout import cluster

    cluster.connect(None, 2)
    try:
        yield str(ray.get_runtime_context().gcs_address)
    finally:
        cluster.disconnect()


@pytest.fixture(scope="package")
def sharded_manifest(tiny_llama_dir: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A locked manifest on the tiny model: 6 prompts, 24 tokens each, logits and activations captured."""
    root = tmp_path_factory.mktemp("sharded")
    path = root / "m.json"
    model = tiny_llama_dir.path
    created = detinf("init", "--output", path, "--model", model, "--n-prompts", "6", "--max-tokens", "24")
    assert created.code == 0, created.err
    edit_manifest(path, {"engine": {"num_kv_blocks": 256},
                         "capture": {"activations": {"enabled": True}, "logits": {"enabled": True}}})
    assert detinf("lock", "--config", path).code == 0
    return path


@pytest.fixture(scope="package")
def one_process_run(sharded_manifest: Path) -> Path:
    """The manifest run in one process: the reference of every sharded run."""
    target = sharded_manifest.parent / "one-process"
    result = detinf("run", "--config", sharded_manifest, "--output-dir", target)
    assert result.code == 0, result.err
    return target
