"""network_policy offline_required: no outbound connection during a run; loopback still works."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from deterministic_inference.workflow.network import OfflineNetworkError, is_loopback_host, offline_guard
from tests.workflow.helpers import detinf, edit_manifest


def test_outbound_connections_fail_inside_the_guard() -> None:
    with offline_guard():
        with pytest.raises(OfflineNetworkError, match="192.0.2.1"):
            socket.create_connection(("192.0.2.1", 80), timeout=1)
        with pytest.raises(urllib.error.URLError) as caught:  # urllib wraps the refusal
            urllib.request.urlopen("http://93.184.216.34/", timeout=1)
        assert isinstance(caught.value.reason, OfflineNetworkError)
        with pytest.raises(OfflineNetworkError, match="name lookup"):
            socket.getaddrinfo("example.com", 443)
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with pytest.raises(OfflineNetworkError, match="datagram"):
            udp.sendto(b"x", ("8.8.8.8", 53))
        udp.close()


def test_loopback_still_works_inside_the_guard() -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    accepted: list[bytes] = []

    def accept() -> None:
        connection, _ = server.accept()
        accepted.append(connection.recv(5))
        connection.close()

    thread = threading.Thread(target=accept)
    thread.start()
    with offline_guard():
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            client.sendall(b"hello")
    thread.join(timeout=5)
    server.close()
    assert accepted == [b"hello"]
    assert all(is_loopback_host(host) for host in ("localhost", "127.0.0.2", "::1", "[::1]"))
    assert not any(is_loopback_host(host) for host in ("10.0.0.1", "example.com", "0.0.0.0"))


def test_guard_restores_the_socket_module_and_environment() -> None:
    before = (socket.socket.connect, socket.getaddrinfo)
    with pytest.raises(RuntimeError), offline_guard():
        raise RuntimeError("boom")
    assert (socket.socket.connect, socket.getaddrinfo) == before


def test_outbound_attempt_fails_in_a_fresh_process() -> None:
    """The whole process is offline inside the guard: a plain urllib request never leaves the host."""
    code = (
        "import urllib.error, urllib.request\n"
        "from deterministic_inference.workflow.network import OfflineNetworkError, offline_guard\n"
        "with offline_guard():\n"
        "    try:\n"
        "        urllib.request.urlopen('http://198.51.100.7:8080/v1/models', timeout=2)\n"
        "    except urllib.error.URLError as error:\n"
        "        assert isinstance(error.reason, OfflineNetworkError)\n"
        "        print('refused:', error.reason)\n"
    )
    command = [sys.executable, "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused: network_policy offline_required")
    assert "198.51.100.7" in done.stdout


def test_connections_fail_while_a_run_executes(tiny_manifest: Path) -> None:
    """A thread of the run process keeps trying to reach a non-loopback address while `run` works."""
    refused: list[str] = []
    stop = threading.Event()

    def knock() -> None:
        while not stop.is_set():
            try:
                socket.create_connection(("192.0.2.1", 9), timeout=0.05).close()
            except OfflineNetworkError as error:
                refused.append(str(error))
            except OSError:
                pass
            stop.wait(0.01)

    thread = threading.Thread(target=knock)
    thread.start()
    try:
        result = detinf("run", "--config", tiny_manifest, "--output-dir", tiny_manifest.parent / "run")
    finally:
        stop.set()
        thread.join(timeout=5)
    assert result.code == 0, result.err
    assert refused and "offline_required" in refused[0]


def test_offline_run_refuses_a_remote_endpoint(tiny_manifest: Path) -> None:
    result = detinf("run", "--config", tiny_manifest, "--base-url", "http://203.0.113.9:8000")
    assert result.code == 2 and "offline_required" in result.err and "203.0.113.9" in result.err


def test_online_allowed_run_is_not_guarded(tiny_manifest: Path) -> None:
    edit_manifest(tiny_manifest, {"runtime": {"network_policy": "online_allowed"}})
    assert detinf("lock", "--config", tiny_manifest).code == 0
    out = tiny_manifest.parent / "run"
    assert detinf("run", "--config", tiny_manifest, "--output-dir", out).code == 0
    assert '"offline_guard": false' in (out / "run_log.json").read_text()
