"""verify grading and diagnostics on a real run of the tiny model and on copies of it rewritten as
another machine or software stack would have written them (same format, ids recomputed)."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from deterministic_inference import fingerprint
from deterministic_inference.workflow import canonical
from deterministic_inference.workflow.rundir import json_bytes, seal_bundle
from deterministic_inference.workflow.verify import verify_paths
from tests.tiny_models import TinyModel
from tests.workflow.helpers import detinf, edit_manifest, read_json

Edit = Callable[[Any], None]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A locked tiny-model manifest and one real run of it: returns the run directory."""
    root = tmp_path_factory.mktemp("verify")
    manifest = root / "tiny.json"
    init = detinf("init", "--output", manifest, "--model", tiny_llama_dir.path, "--n-prompts", "2",
                  "--max-tokens", "5")
    assert init.code == 0, init.err
    edit_manifest(manifest, {"engine": {"num_kv_blocks": 256}})
    assert detinf("lock", "--config", manifest).code == 0
    assert detinf("run", "--config", manifest, "--output-dir", root / "run").code == 0
    return root / "run"


def rewrite(src: Path, dst: Path, files: dict[str, Edit] | None = None, bundle: Edit | None = None) -> Path:
    """Copy a run dir, edit some of its JSON files and bundle.json, recompute every digest and id."""
    shutil.copytree(src, dst)
    for name, edit in (files or {}).items():
        document = read_json(dst / name)
        edit(document)
        (dst / name).write_bytes(json_bytes(document))
    record = read_json(dst / "bundle.json")
    record["files"] = {name: canonical.digest_bytes((dst / name).read_bytes()) for name in record["files"]}
    record["manifest_id"] = canonical.manifest_id(read_json(dst / "manifest.used.json"))
    record["lock_id"] = canonical.lock_id(read_json(dst / "lock.used.json"))
    if bundle:
        bundle(record)
    record["run_id"] = canonical.run_id(record["manifest_id"], record["lock_id"], record["requests_digest"],
                                        record["fingerprint"]["hardware"])
    (dst / "bundle.json").write_bytes(json_bytes(seal_bundle(record)))
    return dst


def other_hardware(record: dict[str, Any]) -> None:
    isa = dict(record["hardware"]["isa"], avx512f=not record["hardware"]["isa"]["avx512f"])
    record["hardware"] = dict(record["hardware"], model_name="Other CPU 9000", isa=isa)
    record["fingerprint"]["hardware"] = fingerprint.digest(record["hardware"])


def other_software(record: dict[str, Any]) -> None:
    record["fingerprint"]["software"] = "sha256:" + "5" * 64


def older_torch(run_log: dict[str, Any]) -> None:
    run_log["runtime_closure"]["software"]["torch"]["version"] = "2.12.0+cpu"


def test_identical_runs_are_conformant(reference: Path, tmp_path: Path) -> None:
    report = verify_paths(reference, rewrite(reference, tmp_path / "copy"))
    assert report["grade"] == "conformant" and report["reasons"] == []
    assert report["outputs"]["tokens"]["equal"] and report["outputs"]["engine_trace"]["equal"]


def non_portable(record: dict[str, Any]) -> None:
    record["fingerprint"]["numerics"] = dict(record["fingerprint"]["numerics"], portable=False)


def test_other_hardware_with_portable_numerics_is_conformant(reference: Path, tmp_path: Path) -> None:
    """Another CPU (model and ISA flags) recorded by a run in portable numerics: same bits, conformant,
    and the report says why."""
    assert read_json(reference / "bundle.json")["fingerprint"]["numerics"]["portable"] is True
    report = verify_paths(reference, rewrite(reference, tmp_path / "hw", bundle=other_hardware))
    assert report["grade"] == "conformant"
    assert "portable numerics" in report["reasons"][0] and "isa.avx512f" in report["reasons"][0]
    assert report["hardware"]["portable_numerics"] and not report["hardware"]["equal"]


def test_other_hardware_with_a_non_portable_path_is_graded_first(reference: Path, tmp_path: Path) -> None:
    def all_three(record: dict[str, Any]) -> None:
        other_hardware(record)
        other_software(record)
        non_portable(record)

    report = verify_paths(reference, rewrite(reference, tmp_path / "hw", bundle=all_three))
    assert report["grade"] == "non_conformant_hardware"
    assert "non-portable" in report["reasons"][0]
    assert "isa.avx512f" in report["reasons"][0] and "model_name" in report["reasons"][0]
    assert report["outputs"]["tokens"]["equal"]  # outputs are still compared and reported


def test_other_software_is_graded_before_outputs(reference: Path, tmp_path: Path) -> None:
    def software_and_tokens(document: dict[str, Any]) -> None:
        document["sequences"][0]["output_token_ids"][0] += 1

    edits: dict[str, Edit] = {"run_log.json": older_torch, "tokens.json": software_and_tokens}
    other = rewrite(reference, tmp_path / "sw", files=edits, bundle=other_software)
    report = verify_paths(reference, other)
    assert report["grade"] == "non_conformant_software"
    assert "torch.version: '2.13.0+cpu' -> '2.12.0+cpu'" in report["reasons"][0]
    assert not report["outputs"]["tokens"]["equal"]


def _run_in_process(manifest: Path, output: Path, **env: str) -> str:
    """`detinf run` in a fresh process with extra environment variables; returns its stderr."""
    command = [sys.executable, "-m", "deterministic_inference", "run", "--config", str(manifest),
               "--output-dir", str(output)]
    done = subprocess.run(command, env=dict(os.environ, **env), capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_other_isa_dispatch_and_kernel_build_are_conformant(reference: Path, tmp_path: Path) -> None:
    """One machine standing in for another: torch's kernels limited to AVX2 and our kernels built for
    x86-64-v3 (what an AVX2-only CPU runs), rewritten as another CPU's record: conformant, the same
    tokens and logits bits, the ISA differences reported as informational."""
    stderr = _run_in_process(reference.parent / "tiny.json", tmp_path / "avx2", ATEN_CPU_CAPABILITY="avx2",
                             DETINF_KERNEL_MARCH="x86-64-v3")
    assert "runtime closure differs from the lock" not in stderr  # the ISA is not part of the closure
    other = rewrite(tmp_path / "avx2", tmp_path / "other-cpu", bundle=other_hardware)
    report = verify_paths(reference, other)
    assert report["grade"] == "conformant", report["reasons"]
    noted = report["hardware"]["informational_differences"]
    assert any("ATEN_CPU_CAPABILITY" in line for line in noted)
    assert any("kernel_march" in line for line in noted)
    assert report["outputs"]["logits"]["compared"] > 0 and report["outputs"]["logits"]["equal"]


def test_non_portable_path_on_other_hardware_is_non_conformant_hardware(
    reference: Path, tmp_path: Path
) -> None:
    """A run with torch's log_softmax on the path (not portable), recorded as another CPU's."""
    _run_in_process(reference.parent / "tiny.json", tmp_path / "torch", DETINF_TEST_TORCH_LOG_SOFTMAX="1")
    assert read_json(tmp_path / "torch" / "bundle.json")["fingerprint"]["numerics"]["portable"] is False
    other = rewrite(tmp_path / "torch", tmp_path / "other-cpu", bundle=other_hardware)
    report = verify_paths(reference, other)
    assert report["grade"] == "non_conformant_hardware"


def _one_ulp_up(value: float) -> float:
    (bits,) = struct.unpack("<I", struct.pack("<f", value))
    return float(struct.unpack("<f", struct.pack("<I", bits + 1))[0])


def _nudge_logprob(document: dict[str, Any]) -> None:
    values = document["sequences"][1]["token_logprobs"]
    values[2] = _one_ulp_up(values[2])


def test_one_ulp_logit_difference(reference: Path, tmp_path: Path) -> None:
    other = rewrite(reference, tmp_path / "ulp", files={"captures/logits.json": _nudge_logprob})
    report = verify_paths(reference, other)
    assert report["grade"] == "mismatch_outputs" and "logits" in report["reasons"][0]
    logits = report["outputs"]["logits"]
    assert logits["max_ulp"] == 1 and logits["histogram"]["1"] == 1
    assert logits["bit_equal"] == logits["compared"] - 1
    first = logits["first_difference"]
    assert (first["request_id"], first["step"], first["ulp"]) == ("req-0001", 2, 1)


def test_ulp_rule_tolerates_what_it_allows(reference: Path, tmp_path: Path) -> None:
    def allow_one_ulp(manifest: dict[str, Any]) -> None:
        manifest["determinism"]["compare"]["logits"] = {"rule": "ulp", "max_ulp": 1}

    base = rewrite(reference, tmp_path / "base", files={"manifest.used.json": allow_one_ulp})
    other = rewrite(base, tmp_path / "ulp", files={"captures/logits.json": _nudge_logprob})
    assert verify_paths(base, other)["grade"] == "conformant"


def test_first_divergent_layer_from_activations(reference: Path, tmp_path: Path) -> None:
    def change_layer(document: dict[str, Any]) -> None:
        row = document["sequences"][0]["digests"][3]
        row[1] = "0" * 64
        row[2] = "1" * 64

    report = verify_paths(reference, rewrite(reference, tmp_path / "act", files={
        "captures/activations.json": change_layer}))
    assert report["grade"] == "mismatch_outputs"
    first = report["outputs"]["activations"]["first_divergence"]
    assert first == {"sequence_id": "req-0000-0", "position": 3, "layer": 1, "layers_differing": 2}


def test_trace_diff_and_report_rule(reference: Path, tmp_path: Path) -> None:
    def change_step(document: dict[str, Any]) -> None:
        document["steps"][1]["chunks"][0]["num_cached_tokens"] = 7

    other = rewrite(reference, tmp_path / "trace", files={"captures/engine_trace.json": change_step})
    report = verify_paths(reference, other)
    assert report["grade"] == "mismatch_outputs"
    assert report["outputs"]["engine_trace"]["first_difference"]["index"] == 1

    def report_only(manifest: dict[str, Any]) -> None:
        manifest["determinism"]["compare"]["engine_trace"] = {"rule": "report"}

    lenient = rewrite(reference, tmp_path / "lenient", files={"manifest.used.json": report_only})
    relaxed = verify_paths(lenient, other)
    assert relaxed["grade"] == "conformant"
    assert relaxed["outputs"]["engine_trace"]["equal"] is False


@pytest.mark.parametrize("damage", ["edit tokens", "edit bundle", "drop bundle", "temp name", "drop file"])
def test_damaged_or_incomplete_runs_are_errors(reference: Path, tmp_path: Path, damage: str) -> None:
    target = tmp_path / ("run" if damage != "temp name" else ".detinf-tmp-run-123")
    shutil.copytree(reference, target)
    if damage == "edit tokens":
        text = (target / "tokens.json").read_text()
        (target / "tokens.json").write_text(text.replace("req-0000", "req-9999"))
    elif damage == "edit bundle":
        (target / "bundle.json").write_text((target / "bundle.json").read_text().replace('"embedded"', '"x"'))
    elif damage == "drop bundle":
        (target / "bundle.json").unlink()
    elif damage == "drop file":
        (target / "captures" / "logits.json").unlink()
    result = detinf("verify", "--bundle-a", reference, "--bundle-b", target, "--output-dir", tmp_path / "v")
    assert result.code == 2 and str(target) in result.err
    assert not (tmp_path / "v").exists()


def _amx_missing() -> str | None:
    from deterministic_inference.ops.native import native_kernels

    return native_kernels().native_gemm_missing()


def test_native_numerics_on_other_hardware_is_non_conformant_hardware(
    reference: Path, tmp_path: Path
) -> None:
    """`engine.numerics: native` (the AMX-BF16 GEMM): the run records portable false, the mode and the ISA;
    a second native run on this CPU is conformant with it, the same run recorded as another CPU's (ISA
    flags and model differ) is non_conformant_hardware."""
    missing = _amx_missing()
    if missing is not None:
        pytest.skip(f"--numerics native cannot run here: {missing}")
    manifest = edit_manifest(reference.parent / "tiny.json", {"engine": {"numerics": "native"}},
                             tmp_path / "native.json")
    assert detinf("lock", "--config", manifest).code == 0
    for name in ("a", "b"):
        assert detinf("run", "--config", manifest, "--output-dir", tmp_path / name).code == 0
    numerics = read_json(tmp_path / "a" / "bundle.json")["fingerprint"]["numerics"]
    assert numerics["portable"] is False and numerics["numerics_mode"] == "native"
    assert numerics["isa"]["cpu"]["amx_bf16"] is True
    assert verify_paths(tmp_path / "a", tmp_path / "b")["grade"] == "conformant"
    other = rewrite(tmp_path / "b", tmp_path / "other-cpu", bundle=other_hardware)
    report = verify_paths(tmp_path / "a", other)
    assert report["grade"] == "non_conformant_hardware"
    assert "non-portable" in report["reasons"][0]
    # against the portable reference: other numerics, graded as a non-portable run beside a portable one
    assert verify_paths(reference, tmp_path / "a")["grade"] != "conformant"
