"""The seed tool's quick start, verbatim: its nine commands with their exact flags, through
`python -m deterministic_inference.cli`, on a tiny model found offline in a Hugging Face cache that the
test builds from local files. Also: the HF cache errors and `init` option conflicts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from deterministic_inference.workflow.hf_cache import hub_cache_dir
from tests.server.harness import free_port, stop_process, wait_healthy
from tests.tiny_models import TinyModel
from tests.workflow.helpers import detinf, edit_manifest, read_json
from tests.workflow.hf_cache_builder import REPO, add_snapshot

STEP_TIMEOUT = 300


def _cli(cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m deterministic_inference.cli ARGS` as a user types it (in `cwd`)."""
    return subprocess.run([sys.executable, "-m", "deterministic_inference.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=STEP_TIMEOUT, check=False)


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.mark.slow
def test_seed_quick_start_verbatim(hf_env: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    commit, env = hf_env
    work = tmp_path / "project"
    work.mkdir()
    # 1) init from the HF cache (id + revision recorded, files hashed)
    _ok(_cli(work, env, "init", "--output", "configs/my-model.json", "--model-id", REPO,
             "--model-revision", commit))
    manifest = work / "configs" / "my-model.json"
    source = read_json(manifest)["model"]["source"]
    assert source == {"type": "huggingface", "repo": REPO, "revision": commit}
    # the user edits the template: serve on a free loopback port, a short run on a small KV pool
    base_url = f"http://127.0.0.1:{free_port()}"
    edit_manifest(manifest, {
        "engine": {"num_kv_blocks": 256},
        "inference": {"n_prompts": 3, "request_template": {"sampling": {"max_tokens": 6}}},
        "runtime": {"execution": {"backend": "openai_compatible", "base_url": base_url}},
    })
    # 2) digest-bootstrap in place and write the lock
    out = _ok(_cli(work, env, "digest-bootstrap", "--config", "configs/my-model.json", "--in-place",
                   "--write-lock"))
    lock_path = work / "configs" / "my-model.lock.json"
    assert "wrote" in out and lock_path.is_file()
    assert read_json(lock_path)["model"]["commit"] == commit
    # 3) lock, 4) build --update-lock
    _ok(_cli(work, env, "lock", "--config", "configs/my-model.json"))
    _ok(_cli(work, env, "build", "--config", "configs/my-model.json", "--update-lock"))
    # 5) serve --config (listens where runtime.execution.base_url points)
    log = tmp_path / "serve.log"
    with open(log, "wb") as handle:
        server = subprocess.Popen([sys.executable, "-m", "deterministic_inference.cli", "serve", "--config",
                                   "configs/my-model.json"], cwd=work, env=env, stdout=handle, stderr=handle)
    try:
        wait_healthy(base_url, process=server)
        assert httpx.get(base_url + "/v1/models", timeout=10).json()["data"][0]["id"] == REPO
        # 6) run --config alone writes runs/<run_id>/ (twice, and once without digest checks)
        _ok(_cli(work, env, "run", "--config", "configs/my-model.json"))
        _ok(_cli(work, env, "run", "--config", "configs/my-model.json"))
        unchecked = _cli(work, env, "run", "--config", "configs/my-model.json",
                         "--no-verify-artifact-digests")
        _ok(unchecked)
        assert "artifact digests not verified" in unchecked.stderr
    finally:
        stop_process(server)
    runs = sorted(path.name for path in (work / "runs").iterdir())
    assert len(runs) == 3 and all((work / "runs" / name / "bundle.json").is_file() for name in runs)
    run_a, run_b = runs[0], runs[1]
    # 7) verify two runs by their bundle.json
    out = _ok(_cli(work, env, "verify", "--bundle-a", f"runs/{run_a}/bundle.json", "--bundle-b",
                   f"runs/{run_b}/bundle.json"))
    assert "grade: conformant" in out
    # 8) bundle a run dir, 9) inspect its bundle.json
    _ok(_cli(work, env, "bundle", "--run-dir", f"runs/{run_a}", "--output",
             f"artifacts/bundles/{run_a}.tar.gz"))
    summary = _ok(_cli(work, env, "inspect", "--input", f"runs/{run_a}/bundle.json"))
    assert f"run_id: sha256:{run_a[:16]}" in summary
    # verify / inspect also take the run dir and the .tar.gz
    out = _ok(_cli(work, env, "verify", "--bundle-a", f"artifacts/bundles/{run_a}.tar.gz", "--bundle-b",
                   f"runs/{runs[2]}"))
    assert "grade: conformant" in out
    inspected = json.loads(_ok(_cli(work, env, "inspect", "--input", f"artifacts/bundles/{run_a}.tar.gz",
                                    "--json")))
    assert inspected["type"] == "run" and inspected["sequences"] == 3


def test_init_from_hf_cache_records_id_revision_and_digests(hf_env: tuple[str, dict[str, str]],
                                                             tmp_path: Path) -> None:
    commit, _ = hf_env
    path = tmp_path / "m.json"
    result = detinf("init", "--output", path, "--model-id", REPO)  # revision: the cache's main
    assert result.code == 0, result.err
    document = read_json(path)
    assert document["model"]["source"] == {"type": "huggingface", "repo": REPO, "revision": "main"}
    assert document["outputs"]["directory"] == "runs/${run_id}"
    names = {entry["path"]: entry["digest"] for entry in document["model"]["files"]}
    assert "model.safetensors" in names and all(d.startswith("sha256:") and d != "sha256:unset"
                                                for d in names.values())
    locked = detinf("lock", "--config", path)
    assert locked.code == 0, locked.err
    assert read_json(tmp_path / "m.lock.json")["model"]["commit"] == commit


def test_missing_hf_snapshot_names_cache_and_fill_command(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "empty-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    result = detinf("init", "--output", tmp_path / "m.json", "--model-id", "org/absent", "--model-revision",
                    "0123456789abcdef0123456789abcdef01234567")
    assert result.code == 2
    assert str(cache) in result.err
    assert "hf download org/absent --revision 0123456789abcdef0123456789abcdef01234567" in result.err
    assert "\n" not in result.err.strip() and not (tmp_path / "m.json").exists()


def test_hf_cache_location_follows_huggingface_hub_order(tmp_path: Path) -> None:
    assert hub_cache_dir({"HF_HUB_CACHE": "/a", "HF_HOME": "/b"}) == Path("/a")
    assert hub_cache_dir({"HUGGINGFACE_HUB_CACHE": "/c", "HF_HOME": "/b"}) == Path("/c")
    assert hub_cache_dir({"HF_HOME": "/b"}) == Path("/b/hub")
    assert hub_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/huggingface/hub")


def test_moved_branch_is_refused_at_run(hf_env: tuple[str, dict[str, str]], tmp_path: Path,
                                        tiny_llama_dir: TinyModel) -> None:
    path = tmp_path / "m.json"
    assert detinf("init", "--output", path, "--model-id", REPO, "--n-prompts", "1").code == 0
    assert detinf("lock", "--config", path).code == 0
    changed = tmp_path / "changed"
    changed.mkdir()
    for item in tiny_llama_dir.path.iterdir():
        (changed / item.name).write_bytes(item.read_bytes())
    (changed / "extra.txt").write_text("a new commit")
    new_commit = add_snapshot(Path(os.environ["HF_HUB_CACHE"]), REPO, changed)
    result = detinf("run", "--config", path, "--output-dir", tmp_path / "run")
    assert result.code == 2 and new_commit in result.err and "$.model.source.revision" in result.err


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--model", "x.gguf", "--model-id", REPO], "--model-id"),
        (["--model-revision", "main"], "--model-revision"),
        (["--model-id", "not a repo id!"], "--model-id"),
    ],
)
def test_init_option_conflicts(args: list[str], field: str, tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    result = detinf("init", "--output", tmp_path / "m.json", *args)
    assert result.code == 2 and field in result.err, result.err


def test_digest_bootstrap_output_and_replace_existing(tiny_manifest: Path) -> None:
    document = read_json(tiny_manifest)
    document["model"]["files"][0]["digest"] = "sha256:" + "0" * 64
    tiny_manifest.write_text(json.dumps(document))
    assert detinf("digest-bootstrap", "--config", tiny_manifest, "--in-place").code == 0
    assert read_json(tiny_manifest)["model"]["files"][0]["digest"] == "sha256:" + "0" * 64  # not unset
    target = tiny_manifest.with_name("filled.json")
    result = detinf("digest-bootstrap", "--config", tiny_manifest, "--output", target, "--replace-existing",
                    "--write-lock")
    assert result.code == 0, result.err
    assert read_json(target)["model"]["files"][0]["digest"] != "sha256:" + "0" * 64
    assert tiny_manifest.with_name("filled.lock.json").is_file()
    with pytest.raises(SystemExit) as refused:  # argparse: one line naming both options, exit 2
        detinf("digest-bootstrap", "--config", tiny_manifest, "--in-place", "--output", target)
    assert refused.value.code == 2
