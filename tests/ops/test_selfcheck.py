"""The start-up self-check: passes in invariant mode at real shapes, fails (naming op and shape) on the
plain path, renders a table and a dict, and is reachable as `detinf selfcheck`."""

from __future__ import annotations

import json
import time

import pytest
import torch

from deterministic_inference.cli.main import main
from deterministic_inference.errors import SelfCheckError
from deterministic_inference.model.decoder import Numerics
from deterministic_inference.model_spec import ModelSpec
from deterministic_inference.ops.selfcheck import SelfCheck, run_selfcheck
from tests.tiny_models import TinyModel

SMOLLM2 = ModelSpec(
    architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
    max_position_embeddings=8192, tie_word_embeddings=True,
)  # fmt: skip
TINY_QWEN3 = ModelSpec(
    architecture="qwen3", vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
    tie_word_embeddings=True, attention_bias=True, qk_norm=True,
)  # fmt: skip
OPS = {"linear", "rms_norm", "silu_mul", "rotary", "attention"}


def test_smollm2_shapes_pass_in_a_few_seconds() -> None:
    start = time.perf_counter()
    report = run_selfcheck(SMOLLM2, Numerics(torch.bfloat16, True, 4), threads=2)
    assert report.ok, report.table()
    assert time.perf_counter() - start < 30  # ~2 s on an idle 2-core machine
    assert {r.op for r in report.results} == OPS
    assert any("49152" in r.shape for r in report.results)  # the fp32 logits head at vocab width
    report.raise_if_failed()


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_the_q8_kv_cache_is_probed_when_selected(batch_invariant: bool) -> None:
    """With a q8_0 cache the attention probe runs over it (its label says so) and passes; with plain
    torch ops (the negative control) it fails."""
    check = SelfCheck(SMOLLM2, Numerics(torch.bfloat16, batch_invariant, 4), 2, kv_cache_format=torch.int8)
    check.probe_ops()
    attention = [r for r in check.probe_weights().results if r.op == "attention"]
    assert len(attention) == 1 and "kv cache q8_0" in attention[0].shape
    assert attention[0].ok is batch_invariant, attention[0].detail


def test_native_numerics_probe_the_amx_gemm_and_catch_a_batch_dependent_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under native numerics every bf16 linear (logits head included) is probed on the AMX-BF16 GEMM, also
    at 16 and 17 rows, and passes; on a build whose GEMM sends a partial row tile elsewhere (the negative
    control) the linear probes fail."""
    from deterministic_inference.ops import backend
    from deterministic_inference.ops.native import load, native_kernels
    from deterministic_inference.ops.native_build import build, cache_dir

    missing = native_kernels().native_gemm_missing()
    if missing is not None:
        pytest.skip(f"--numerics native cannot run here: {missing}")
    numerics = Numerics(torch.bfloat16, True, 4, native_gemm=True)
    report = SelfCheck(SMOLLM2, numerics, 2).probe_weights()
    linears = [r for r in report.results if r.op == "linear"]
    assert report.ok, report.table()
    assert len(linears) == 5 and all("AMX-BF16" in r.shape and "16,17" in r.detail for r in linears)
    test_builds = cache_dir().parent / "test-builds"  # tests/ops/conftest.py's build_dir
    ragged = load(build(("-march=native", "-DDETINF_TEST_AMX_RAGGED_OTHER"), test_builds))
    monkeypatch.setattr(backend, "native_kernels", lambda: ragged)
    failed = SelfCheck(SMOLLM2, numerics, 2).probe_weights()
    assert {r.op for r in failed.failures} == {"linear"}, failed.table()


def test_tiny_qwen3_fp32_passes_and_renders() -> None:
    previous = torch.get_num_threads()
    report = run_selfcheck(TINY_QWEN3, Numerics(torch.float32, True, 8), threads=1)
    assert torch.get_num_threads() == previous  # restored
    assert report.ok, report.table()
    table = report.table()
    assert "attention" in table and "[M, 16] fp32" in table  # qk-norm width probed
    assert table.splitlines()[-1].startswith("all probes bitwise equal")
    data = json.loads(json.dumps(report.to_dict()))
    assert data["ok"] is True and data["threads"] == 1 and len(data["probes"]) == len(report.results)


def test_two_passes_probe_what_one_pass_does() -> None:
    numerics = Numerics(torch.float32, True, 8)
    whole = run_selfcheck(TINY_QWEN3, numerics, threads=1)
    check = SelfCheck(TINY_QWEN3, numerics, threads=1)
    check.probe_ops()
    seconds = check.seconds
    check.probe_ops()  # runs once
    assert check.seconds == seconds
    passes = check.probe_weights()
    assert [vars(r) for r in passes.results] == [vars(r) for r in whole.results]
    assert passes.ok and passes.seconds >= seconds


def test_negative_control_plain_path_fails_naming_op_and_shape() -> None:
    report = run_selfcheck(SMOLLM2, Numerics(torch.float32, False, 4), threads=1)
    assert not report.ok
    failed = {r.op for r in report.failures}
    assert {"linear", "attention"} <= failed, report.table()
    with pytest.raises(SelfCheckError, match=r"linear qkv 576->960 fp32"):
        report.raise_if_failed()
    assert "FAIL" in report.table()


def test_cli_selfcheck_json(tiny_llama_dir: TinyModel, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["selfcheck", "--model", str(tiny_llama_dir.path), "--dtype", "float32", "--threads", "1", "--json"]
    )
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["ok"] is True and data["dtype"] == "float32"
    assert {probe["op"] for probe in data["probes"]} == OPS


def test_cli_selfcheck_table(tiny_llama_dir: TinyModel, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["selfcheck", "--model", str(tiny_llama_dir.path), "--threads", "1"]) == 0
    assert "all probes bitwise equal" in capsys.readouterr().out
