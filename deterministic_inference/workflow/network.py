"""``network_policy: offline_required``: no outbound connection can be made while a run executes.

`offline_guard()` is a context manager for the run process. While it is active every socket connect
(``socket.socket.connect`` / ``connect_ex``, and so ``socket.create_connection``, httpx, urllib and
asyncio), every ``sendto`` and every name lookup (``socket.getaddrinfo``) is checked: Unix sockets and
loopback addresses (127.0.0.0/8, ::1, ``localhost``) pass, anything else raises `OfflineNetworkError`
naming the address. The original functions are restored on exit, also after an error. Hub libraries
are told to stay offline too (``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE``) for the same span.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from deterministic_inference.errors import WorkflowError

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class OfflineNetworkError(WorkflowError, ConnectionRefusedError):
    """An outbound network operation was attempted under ``network_policy: offline_required``."""


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals; False for every other name or address."""
    text = host.strip("[]").split("%", 1)[0]
    if text.lower() in ("localhost", "localhost.", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(text).is_loopback
    except ValueError:
        return False


def url_is_loopback(url: str) -> bool:
    """True when a URL's host is loopback."""
    return is_loopback_host(urlsplit(url).hostname or "")


def _check_address(family: int, address: Any, operation: str) -> None:
    if family == getattr(socket, "AF_UNIX", None):
        return
    host = address[0] if isinstance(address, tuple) and address else address
    if isinstance(host, bytes):
        host = host.decode("ascii", "replace")
    if not is_loopback_host(str(host)):
        raise OfflineNetworkError(
            f"network_policy offline_required: outbound {operation} to {address!r} refused; "
            "set runtime.network_policy to online_allowed if the run needs the network"
        )


@contextmanager
def offline_guard() -> Iterator[None]:
    """Refuse non-loopback connections, datagrams and name lookups inside the block."""
    original_connect = socket.socket.connect
    original_connect_ex = socket.socket.connect_ex
    original_sendto = socket.socket.sendto
    original_getaddrinfo = socket.getaddrinfo

    def connect(self: socket.socket, address: Any) -> None:
        _check_address(self.family, address, "connection")
        original_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        _check_address(self.family, address, "connection")
        return original_connect_ex(self, address)

    def sendto(self: socket.socket, data: bytes, *args: Any) -> int:
        _check_address(self.family, args[-1], "datagram")
        result: int = original_sendto(self, data, *args)
        return result

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host is not None:
            _check_address(socket.AF_INET, (host,), "name lookup")
        return original_getaddrinfo(host, *args, **kwargs)

    saved_env = {name: os.environ.get(name) for name in OFFLINE_ENV}
    patches: list[tuple[Any, str, Callable[..., Any]]] = [
        (socket.socket, "connect", connect), (socket.socket, "connect_ex", connect_ex),
        (socket.socket, "sendto", sendto), (socket, "getaddrinfo", getaddrinfo),
    ]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    os.environ.update(OFFLINE_ENV)
    try:
        yield
    finally:
        socket.socket.connect = original_connect  # type: ignore[method-assign]
        socket.socket.connect_ex = original_connect_ex  # type: ignore[method-assign]
        socket.socket.sendto = original_sendto  # type: ignore[method-assign]
        socket.getaddrinfo = original_getaddrinfo
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
