"""Connecting to Ray: an existing cluster (`--ray-address ADDR`) or a private local one on loopback.

The only place that calls `ray.init`. A local instance (no address, or ``local``) binds its node to
127.0.0.1, starts no dashboard, and declares at least `num_cpus` logical CPUs so N replicas or shards
fit on a small machine (Ray's CPUs are scheduling units; the engines' threads are set by `--threads`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from deterministic_inference.errors import ConfigError

LOCAL = "local"
NAMESPACE = "detinf"


def connect(address: str | None, num_cpus: int) -> bool:
    """ray.init for `address` (None or "local": a new local instance on loopback). Returns True when this
    call connected (the caller disconnects; a local instance stops then), False when Ray was already
    initialized in this process."""
    import ray

    if ray.is_initialized():
        return False
    local = address in (None, "", LOCAL)
    options: dict[str, Any] = {
        "namespace": NAMESPACE,
        "logging_level": logging.WARNING,
        "log_to_driver": False,
    }
    if local:
        options.update(
            address="local",
            num_cpus=max(num_cpus, os.cpu_count() or 1),
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
        )
    else:
        options["address"] = address
    try:
        ray.init(**options)
    except (ConnectionError, ValueError, RuntimeError) as error:
        where = "a local Ray instance" if local else f"the Ray cluster at {address}"
        raise ConfigError(
            f"--ray-address: could not start or reach {where} ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else 'no detail'}); check the address "
            "(host:port of the head node's GCS) or omit it for a local instance"
        ) from None
    return True


def disconnect() -> None:
    """ray.shutdown (this process's connection; a local instance it started stops with it)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
