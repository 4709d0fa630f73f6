"""A local Ray instance on loopback (2 CPUs) for the scale-out tests; this test process is its driver.

Package-scoped: started when the first Ray test needs it and stopped after the package's tests.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest


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
