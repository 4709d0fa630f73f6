"""`detinf run --ray-address ADDR --shards 2` writes the one-process run directory's outputs.

The runs use the local Ray instance of the package (`ray_cluster`) through its address, from a separate
`detinf` process like a user's. One one-process run of the same manifest is the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.scaleout.helpers import check_conformant, run_sharded
from tests.workflow.helpers import detinf, read_json

pytestmark = pytest.mark.slow


def test_sharded_run_equals_one_process(sharded_manifest: Path, one_process_run: Path, ray_cluster: str,
                                        tmp_path: Path) -> None:
    code, output = run_sharded(sharded_manifest, tmp_path / "sharded", ray_cluster, {})
    assert code == 0, output
    assert "capture.engine_trace: not written for a sharded run" in output  # the manifest captures it
    assert json.loads(sharded_manifest.read_text())["capture"]["engine_trace"]["enabled"]
    check_conformant(one_process_run, tmp_path / "sharded", tmp_path / "report")
    shards = read_json(tmp_path / "sharded" / "run_log.json")["shards"]
    assert [s["num_requests"] for s in shards] == [3, 3]
    for shard in shards:
        assert shard["hardware"]["isa"] and shard["hardware_digest"].startswith("sha256:")
        assert [a["outcome"] for a in shard["attempts"]] == ["ok"]


def test_a_killed_shard_worker_is_retried(sharded_manifest: Path, one_process_run: Path, ray_cluster: str,
                                          tmp_path: Path) -> None:
    code, output = run_sharded(sharded_manifest, tmp_path / "sharded", ray_cluster, {2: 1})
    assert code == 0, output
    assert "shard 2/2 failed" in output and "retrying once" in output
    shards = read_json(tmp_path / "sharded" / "run_log.json")["shards"]
    outcomes = [a["outcome"] for a in shards[1]["attempts"]]
    assert len(outcomes) == 2 and outcomes[0].startswith("failed") and outcomes[1] == "ok", outcomes
    check_conformant(one_process_run, tmp_path / "sharded", tmp_path / "report")


def test_a_shard_failing_twice_fails_the_run(sharded_manifest: Path, ray_cluster: str,
                                             tmp_path: Path) -> None:
    target = tmp_path / "sharded"
    code, output = run_sharded(sharded_manifest, target, ray_cluster, {1: 2})
    assert code == 2, output
    assert "shard 1/2 failed 2 times" in output and "no run directory was written" in output
    assert not target.exists() and not list(tmp_path.glob(".detinf-tmp-*"))


def test_bad_ray_options_are_refused(sharded_manifest: Path, tmp_path: Path) -> None:
    result = detinf("run", "--config", sharded_manifest, "--output-dir", tmp_path / "x", "--shards", "2")
    assert result.code == 2 and "--shards: needs --ray-address" in result.err
    result = detinf("run", "--config", sharded_manifest, "--output-dir", tmp_path / "x",
                    "--ray-address", "local", "--base-url", "http://127.0.0.1:9")
    assert result.code == 2 and "--ray-address: shards run the embedded engine" in result.err
    result = detinf("run", "--config", sharded_manifest, "--output-dir", tmp_path / "x",
                    "--ray-address", "local", "--shards", "0")
    assert result.code == 2 and "--shards: 0 must be >= 1" in result.err
    assert not (tmp_path / "x").exists()
