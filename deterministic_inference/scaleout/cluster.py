"""Connecting to Ray: an existing cluster (`--ray-address ADDR`) or a private local one on loopback.

The only place that calls `ray.init`. A local instance (no address, or ``local``) advertises its node at
127.0.0.1, starts no dashboard, and declares at least `num_cpus` logical CPUs so N replicas or shards
fit on a small machine (Ray's CPUs are scheduling units; the engines' threads are set by `--threads`).

Ray turns a loopback `_node_ip_address` into the machine's routable address unless its single-machine
mode is on (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, the default on macOS/Windows); a local instance turns
that mode on, in this process and (through the environment) in the workers it starts, so all its
traffic stays on loopback.

Token authentication (Ray >= 2.60): `ray start --head` enables it when a token exists (`~/.ray/auth_token`,
written by any local `ray.init` or `ray get-auth-token --generate`), but a client given an explicit
address uses it only when `RAY_AUTH_MODE=token` is set, and Ray then just fails to connect after its
retries. Before `ray.init` we ask the cluster's GCS one RPC without a token: if it refuses it as
unauthenticated and this process is not in token mode, the error says which variable to set and where
the token comes from, at once.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from deterministic_inference.errors import ConfigError

LOCAL = "local"
NAMESPACE = "detinf"
SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
AUTH_MODE_ENV = "RAY_AUTH_MODE"  # "token": this process sends the cluster's token
TOKEN_SOURCES = "the RAY_AUTH_TOKEN variable, else the file RAY_AUTH_TOKEN_PATH names, else ~/.ray/auth_token"
PROBE_METHOD = "/ray.rpc.NodeInfoGcsService/GetClusterId"  # any GCS call; it takes an empty request
PROBE_TIMEOUT = 5.0  # seconds the GCS gets to answer the probe


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
    if address is not None and not local:
        _refuse_missing_token(address)
    try:
        ray.init(**options)
    except Exception as error:  # noqa: BLE001 - Ray's failures to connect become one line naming the fix
        raise _connect_error(error, address, local) from None
    return True


def _connect_error(error: Exception, address: str | None, local: bool) -> ConfigError:
    """The one-line error for a failed `ray.init` (authentication failures name the token's sources)."""
    from ray.exceptions import AuthenticationError

    where = "a local Ray instance" if local else f"the Ray cluster at {address}"
    if isinstance(error, AuthenticationError):
        return ConfigError(f"--ray-address: {AUTH_MODE_ENV}=token is set but no token was found for {where}: "
                           f"give it the head's token ({TOKEN_SOURCES})")
    if not local and address is not None and gcs_requires_token(address):
        return ConfigError(f"--ray-address: {where} refused this machine's token: give it the head's token "
                           f"({TOKEN_SOURCES}; the head's is in its ~/.ray/auth_token)")
    if not isinstance(error, (ConnectionError, ValueError, RuntimeError)):
        raise error
    detail = str(error).splitlines()[0] if str(error) else "no detail"
    return ConfigError(
        f"--ray-address: could not start or reach {where} ({type(error).__name__}: {detail}); check the "
        "address (host:port of the head node's GCS) or omit it for a local instance"
    )


def _refuse_missing_token(address: str) -> None:
    """ConfigError at once when the cluster wants a token and this process would not send one."""
    if os.environ.get(AUTH_MODE_ENV, "").lower() == "token" or not gcs_requires_token(address):
        return
    raise ConfigError(
        f"--ray-address: the Ray cluster at {address} requires token authentication: set "
        f"{AUTH_MODE_ENV}=token and give this machine the head's token ({TOKEN_SOURCES}); see "
        "docs/scale-out.md"
    )


def gcs_requires_token(address: str) -> bool:
    """True when the GCS at `address` (host:port) refuses a call without a token as unauthenticated;
    False when it answers it, when nothing answers within PROBE_TIMEOUT, or for other address forms
    (`ray://...`, `auto`)."""
    if "://" in address or ":" not in address:
        return False
    import grpc

    with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        call = channel.unary_unary(
            PROBE_METHOD, request_serializer=lambda body: body, response_deserializer=lambda body: body
        )
        try:
            call(b"", timeout=PROBE_TIMEOUT)
        except grpc.RpcError as error:
            return bool(error.code() == grpc.StatusCode.UNAUTHENTICATED)  # type: ignore[attr-defined]
    return False


def disconnect() -> None:
    """ray.shutdown (this process's connection; a local instance it started stops with it)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
