"""Rope scaling's inverse frequencies and attention factors against transformers' own functions, the
portable powers against the kernels' inverse frequencies (bit for bit), and LongRoPE's factor choice."""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import subprocess
import sys
from typing import Any

import pytest
import torch

from deterministic_inference.model_spec import RopeScaling
from deterministic_inference.ops import portable
from deterministic_inference.ops.native import NativeKernels, native_kernels
from deterministic_inference.ops.rope import RotaryTable, inverse_frequencies
from deterministic_inference.ops.rope_scaling import longrope_uses_long_factors, rope_variant

HEAD_DIM, THETA, CONTEXT, ORIGINAL = 64, 1_000_000.0, 4096, 512
LONG = [1.0 + 0.1 * j for j in range(HEAD_DIM // 2)]
SHORT = [1.0 + 0.01 * j for j in range(HEAD_DIM // 2)]

CASES: dict[str, tuple[dict[str, Any], RopeScaling]] = {
    "linear": ({"rope_type": "linear", "factor": 8.0}, RopeScaling("linear", factor=8.0)),
    "llama3": (
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": ORIGINAL},
        RopeScaling("llama3", 8.0, ORIGINAL, low_freq_factor=1.0, high_freq_factor=4.0),
    ),
    "yarn": (
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL},
        RopeScaling("yarn", 8.0, ORIGINAL),
    ),
    "yarn-untruncated-mscale": (
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL, "truncate": False,
         "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16.0, "beta_slow": 2.0},
        RopeScaling("yarn", 8.0, ORIGINAL, truncate=False, mscale=0.707, mscale_all_dim=1.0, beta_fast=16.0,
                    beta_slow=2.0),
    ),
    "longrope": (
        {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
         "original_max_position_embeddings": ORIGINAL},
        RopeScaling("longrope", CONTEXT / ORIGINAL, ORIGINAL, short_factor=tuple(SHORT),
                    long_factor=tuple(LONG)),
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    return native_kernels()


def transformers_frequencies(rope: dict[str, Any], seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM, max_position_embeddings=CONTEXT,
        rope_parameters={"rope_theta": THETA, **rope},
    )  # fmt: skip
    inv_freq, attention = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu", seq_len=seq_len)
    return inv_freq.float(), float(attention)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("portable_kernels", [True, False])
def test_frequencies_and_attention_factor_match_transformers(
    case: str, portable_kernels: bool, kernels: NativeKernels
) -> None:
    """Ours differ from HF's only by its pow (torch) vs our portable pow: a few ulps; HF's longrope with a
    sequence longer than the original context uses the long factors, as ours with CONTEXT does."""
    rope, scaling = CASES[case]
    expected, expected_attention = transformers_frequencies(rope, seq_len=CONTEXT)
    ours, attention = inverse_frequencies(
        HEAD_DIM, THETA, scaling, kernels if portable_kernels else None, CONTEXT
    )
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0.0)
    assert attention == pytest.approx(expected_attention, rel=1e-14)
    if case != "linear" and case != "llama3":
        assert attention != 1.0
    unscaled, _ = inverse_frequencies(HEAD_DIM, THETA, None, kernels, CONTEXT)
    assert not torch.allclose(ours, unscaled, rtol=1e-3)  # negative control: the scaling changes them


def test_longrope_short_factors_for_a_short_context(kernels: NativeKernels) -> None:
    """A context of at most original_max_position_embeddings rotates with the short factors (HF's choice
    for every sequence that fits it)."""
    rope, scaling = CASES["longrope"]
    expected, _ = transformers_frequencies(rope, seq_len=ORIGINAL)
    ours, _ = inverse_frequencies(HEAD_DIM, THETA, scaling, kernels, ORIGINAL)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0.0)
    assert not longrope_uses_long_factors(scaling, ORIGINAL)
    assert longrope_uses_long_factors(scaling, ORIGINAL + 1)
    assert rope_variant(scaling, ORIGINAL) == "rope_longrope_short"
    assert rope_variant(scaling, ORIGINAL + 1) == "rope_longrope_long"


def test_variant_names() -> None:
    assert rope_variant(None, CONTEXT) is None
    assert rope_variant(CASES["yarn"][1], CONTEXT) == "rope_yarn"
    assert (
        rope_variant(RopeScaling("llama3", freq_factors=(1.0,) * 32), CONTEXT) == "rope_llama3_freq_factors"
    )


@pytest.mark.parametrize(("theta", "head_dim"), [(10000.0, 64), (500000.0, 128), (1_000_000.0, 16)])
def test_portable_powers_invert_to_the_kernel_frequencies(
    kernels: NativeKernels, theta: float, head_dim: int
) -> None:
    """1 / rope_powers (one fp32 division) is, bit for bit, the kernels' own inverse frequencies: the
    scaled tables start from the same portable pow as the unscaled ones."""
    inverted = 1.0 / portable.rope_powers(kernels, theta, head_dim)
    kernel = portable.inverse_frequencies(kernels, theta, head_dim)
    assert torch.equal(inverted.view(torch.int32), kernel.view(torch.int32))


def test_portable_log_is_close_to_libm(kernels: NativeKernels) -> None:
    for value in (2.0, 8.0, 512.0, 32768.0, 1e6, 0.3):
        assert portable.natural_log(kernels, value) == pytest.approx(math.log(value), rel=1e-15)


def test_attention_factor_multiplies_both_tables(kernels: NativeKernels) -> None:
    """YaRN's tables are the plain tables of its frequencies times fp32(factor), entry by entry (bits),
    also after they grow."""
    scaling = CASES["yarn"][1]
    table = RotaryTable(HEAD_DIM, THETA, 10_000, scaling, kernels=kernels)
    inv_freq, factor = inverse_frequencies(HEAD_DIM, THETA, scaling, kernels, 10_000)
    table.cover(torch.tensor([5000]))
    cos, sin = portable.rotary_tables(kernels, inv_freq, table.cos.shape[0])
    assert torch.equal((cos * factor).view(torch.int32), table.cos.view(torch.int32))
    assert torch.equal((sin * factor).view(torch.int32), table.sin.view(torch.int32))
    assert not torch.equal(cos.view(torch.int32), table.cos.view(torch.int32))


_TABLES_SCRIPT = """
import hashlib, json, sys
import torch
from deterministic_inference.ops.native import native_kernels
from deterministic_inference.ops.rope import RotaryTable
from tests.ops.test_rope_scaling import CASES, HEAD_DIM, THETA

kernels = native_kernels() if sys.argv[1] == "portable" else None
digests = {"capability": torch.backends.cpu.get_cpu_capability()}
for name, (_, scaling) in CASES.items():
    table = RotaryTable(HEAD_DIM, THETA, 8192, scaling, kernels=kernels)
    table.cover(torch.tensor([8191]))
    data = table.cos.numpy().tobytes() + table.sin.numpy().tobytes()
    digests[name] = hashlib.sha256(data).hexdigest()
print(json.dumps(digests))
"""


def table_digests(path: str, capability: str) -> dict[str, str]:
    """sha256 of every case's cos and sin tables (8192 positions) in a process whose torch dispatches to
    `capability` (read once at start-up: hence a process each)."""
    environ = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    command = [sys.executable, "-c", _TABLES_SCRIPT, path]
    done = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    digests: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    assert digests.pop("capability") == capability.upper()
    return digests


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 ISA switches")
def test_scaled_tables_same_bits_whatever_torch_dispatches_to(kernels: NativeKernels) -> None:
    """The scaled portable tables (powers, logs, cos and sin in our kernels; the scaling's elementwise
    steps in torch) are the same bits with torch's AVX2 and scalar kernels. Control: the digest sees a
    one-ulp change of one frequency (torch's own tables happen to agree across these ISAs here, so they
    cannot serve as the control)."""
    assert table_digests("portable", "avx2") == table_digests("portable", "default")
    inv_freq, _ = inverse_frequencies(HEAD_DIM, THETA, CASES["yarn"][1], kernels, 8192)
    nudged = inv_freq.clone()
    nudged[5] = torch.nextafter(nudged[5], torch.tensor(1.0))
    digests = {
        hashlib.sha256(
            b"".join(t.numpy().tobytes() for t in portable.rotary_tables(kernels, f, 8192))
        ).hexdigest()
        for f in (inv_freq, nudged)
    }
    assert len(digests) == 2
