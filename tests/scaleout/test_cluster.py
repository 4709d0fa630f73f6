"""`--ray-address` against a cluster started with Ray's CLI (`ray start --head`), which turned token
authentication on by itself: without RAY_AUTH_MODE the error names the variable and the token file at
once; with it, a 2-shard run is conformant with the one-process run; a wrong token is named as such."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from deterministic_inference.scaleout.cluster import gcs_requires_token
from tests.scaleout.helpers import check_conformant, run_sharded
from tests.scaleout.ray_cli import CliHead, cli_head
from tests.server.harness import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def head() -> Iterator[CliHead]:
    with cli_head() as running:
        yield running


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("detinf run: error:")]


def test_ray_start_turned_token_authentication_on(head: CliHead) -> None:
    """The probe the error relies on: this head refuses a call without a token; nothing listening is no
    such refusal, and neither is an address form it cannot probe."""
    assert gcs_requires_token(head.address)
    assert not gcs_requires_token(f"127.0.0.1:{free_port()}")
    assert not gcs_requires_token("ray://" + head.address)


def test_without_ray_auth_mode_the_error_names_the_variable_and_the_token_file(
    head: CliHead, sharded_manifest: Path, tmp_path: Path
) -> None:
    code, output = run_sharded(sharded_manifest, tmp_path / "run", head.address, {}, env=head.client_env)
    assert code == 2, output
    [line] = error_lines(output)
    assert f"the Ray cluster at {head.address} requires token authentication" in line
    assert "RAY_AUTH_MODE=token" in line and "~/.ray/auth_token" in line and "RAY_AUTH_TOKEN_PATH" in line
    assert "Unauthenticated" not in output  # failed before Ray's own retries (and their log lines)
    assert not (tmp_path / "run").exists()


def test_with_ray_auth_mode_token_a_sharded_run_is_conformant(
    head: CliHead, sharded_manifest: Path, one_process_run: Path, tmp_path: Path
) -> None:
    env = {**head.client_env, "RAY_AUTH_MODE": "token"}
    code, output = run_sharded(sharded_manifest, tmp_path / "sharded", head.address, {}, env=env)
    assert code == 0, output
    check_conformant(one_process_run, tmp_path / "sharded", tmp_path / "report")


def test_a_wrong_token_is_named(head: CliHead, sharded_manifest: Path, tmp_path: Path) -> None:
    wrong = tmp_path / "not-the-heads-token"
    wrong.write_text(secrets.token_hex(32))
    env = {**head.client_env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(wrong)}
    code, output = run_sharded(sharded_manifest, tmp_path / "run", head.address, {}, env=env)
    assert code == 2, output
    [line] = error_lines(output)
    assert f"the Ray cluster at {head.address} refused this machine's token" in line
    assert "RAY_AUTH_TOKEN_PATH" in line
