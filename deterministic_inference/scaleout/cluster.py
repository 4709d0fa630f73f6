"""Connecting to Ray: an existing cluster (`--ray-address ADDR`) or a private local one on loopback.

The only place that calls `ray.init`. A local instance (no address, or ``local``) advertises its node at
127.0.0.1, starts no dashboard, and declares at least `num_cpus` logical CPUs so N replicas or shards
fit on a small machine (Ray's CPUs are scheduling units; the engines' threads are set by `--threads`).

Ray turns a loopback `_node_ip_address` into the machine's routable address unless its single-machine
mode is on (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, the default on macOS/Windows); a local instance turns
that mode on, in this process and (through the environment) in the workers it starts, so all its
traffic stays on loopback.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from deterministic_inference.errors import ConfigError

LOCAL = "local"
NAMESPACE = "detinf"
SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def connect(address: str | None, num_cpus: int) -> bool:
    """ray.init for `address` (None or "local": a new local instance on loopback). Returns True when this
    call connected (the caller disconnects; a local instance stops then), False when Ray was already
    initialized in this process."""
    local = address in (None, "", LOCAL)
    if local:
        os.environ[SINGLE_MACHINE_ENV] = "0"
    import ray
    from ray._private import ray_constants

    if ray.is_initialized():
        return False
    if local:
        ray_constants.ENABLE_RAY_CLUSTER = False  # read at call time; ray may have been imported already
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
