"""One machine standing in for many: the same requests give the same bits whatever ISA torch dispatches
to (ATEN_CPU_CAPABILITY avx512 / avx2 / default), whatever -march the kernels are built for
(DETINF_KERNEL_MARCH native / x86-64-v3 / x86-64), with oneDNN limited (ONEDNN_MAX_CPU_ISA) and with 1 or
2 threads: greedy and seeded requests (batched and per-row sampler paths), top logprobs, prompt
logprobs, a mixed batch prefilled in chunks.

Each setting runs in its own process (`portable_probe`), since torch and oneDNN read their ISA switches
once at start-up. Outputs are compared as exact token ids and raw float32 bits. Negative control: with
torch's log_softmax put back on the path (DETINF_TEST_TORCH_LOG_SOFTMAX=1) the same comparison sees the
ISA change the logprob bits.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.kernel_builds import build_together
from tests.tiny_models import TinyModel

X86 = platform.machine().lower() in ("x86_64", "amd64")
pytestmark = pytest.mark.skipif(not X86, reason="the ISA switches under test are x86-64 ones")

# (label, environment, threads): together they take every value of every switch at least once
BASE = ("avx512 / native / 2 threads", {"ATEN_CPU_CAPABILITY": "avx512"}, 2)
VARIANTS = (
    ("avx2 / x86-64-v3 / oneDNN AVX2 / 1 thread",
     {"ATEN_CPU_CAPABILITY": "avx2", "DETINF_KERNEL_MARCH": "x86-64-v3", "ONEDNN_MAX_CPU_ISA": "AVX2"}, 1),
    ("default / x86-64 / oneDNN SSE41 / 2 threads",
     {"ATEN_CPU_CAPABILITY": "default", "DETINF_KERNEL_MARCH": "x86-64", "ONEDNN_MAX_CPU_ISA": "SSE41"}, 2),
)  # fmt: skip
SWITCHES = ("ATEN_CPU_CAPABILITY", "DETINF_KERNEL_MARCH", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
TORCH_LOG_SOFTMAX = {"DETINF_TEST_TORCH_LOG_SOFTMAX": "1"}


def cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return set(
        next((line.split(":", 1)[1] for line in text.splitlines() if line.startswith("flags")), "").split()
    )


def probe(cases: list[str], env: dict[str, str], threads: int) -> list[dict[str, Any]]:
    """Run the probe in a fresh process with exactly these switches set."""
    environ = {
        k: v for k, v in os.environ.items() if k not in SWITCHES and k != "DETINF_TEST_TORCH_LOG_SOFTMAX"
    }
    environ.update(env)
    command = [sys.executable, "-m", "tests.engine.portable_probe", "--threads", str(threads)]
    for case in cases:
        command += ["--case", case]
    done = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def expected_capability(env: dict[str, str]) -> str:
    return env.get("ATEN_CPU_CAPABILITY", "avx512").upper()


@pytest.fixture(scope="module")
def tiny_cases(tiny_llama_dir: TinyModel, tiny_qwen3_dir: TinyModel) -> list[str]:
    """The tiny Llama in fp32 (the fp32 GEMM) and the tiny Qwen3 in bf16 (bf16 GEMM, q/k norms)."""
    return [f"{tiny_llama_dir.path}:float32", f"{tiny_qwen3_dir.path}:bfloat16"]


@pytest.fixture(scope="module")
def avx512() -> None:
    """Skips without AVX-512; else builds (or finds in the kernel cache the probes use) the kernels of
    every -march the settings name, all together (tests/kernel_builds.py), before the first probe."""
    if "avx512f" not in cpu_flags():
        pytest.skip("the reference setting dispatches torch to AVX-512, which this CPU lacks")
    marches = sorted({env.get("DETINF_KERNEL_MARCH", "native") for _, env, _ in (BASE, *VARIANTS)})
    build_together([((f"-march={march}",), None) for march in marches])


def differing(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[str]:
    """Which (case, request, field) differ between two probe outputs."""
    found = []
    for case, (run_a, run_b) in enumerate(zip(a, b, strict=True)):
        for request, (ra, rb) in enumerate(zip(run_a["results"], run_b["results"], strict=True)):
            found += [f"case {case} request {request} {key}" for key in ra if ra[key] != rb[key]]
    return found


@pytest.mark.slow
def test_tiny_models_same_bits_under_every_isa_switch(avx512: None, tiny_cases: list[str]) -> None:
    label, env, threads = BASE
    reference = probe(tiny_cases, env, threads)
    assert all(run["results"][0]["prompt_logprobs"] for run in reference)  # prompt logprobs were asked
    for label, env, threads in VARIANTS:
        got = probe(tiny_cases, env, threads)
        assert [run["cpu_capability"] for run in got] == [expected_capability(env)] * len(got), label
        assert differing(reference, got) == [], label


@pytest.mark.slow
def test_negative_control_torch_log_softmax_on_the_path_is_detected(
    avx512: None, tiny_cases: list[str]
) -> None:
    """The same comparison with torch's log_softmax in place of the kernel: the ISA it dispatches to
    changes logprob bits, and the test sees it."""
    label, env, threads = BASE
    reference = probe(tiny_cases, {**env, **TORCH_LOG_SOFTMAX}, threads)
    _, other_env, other_threads = VARIANTS[1]  # torch's scalar (default) kernels
    found = differing(reference, probe(tiny_cases, {**other_env, **TORCH_LOG_SOFTMAX}, other_threads))
    assert any("logprobs" in where for where in found), found


@pytest.mark.slow
def test_default_model_same_bits_on_scalar_dispatch_and_sse2_kernels(avx512: None) -> None:
    """The real default model (quantized GEMMs, bf16 activations): AVX-512 dispatch and native kernels
    vs torch's scalar kernels with an x86-64 build of ours (SSE2 only)."""
    reference = probe(["default:auto"], BASE[1], BASE[2])
    label, env, threads = VARIANTS[1]
    assert differing(reference, probe(["default:auto"], env, threads)) == [], label
