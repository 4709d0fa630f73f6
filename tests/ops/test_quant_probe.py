"""The start-up probe of the quantized linears (ops/quant_probe.py): it passes on the real kernels for
every format, names the op, format and shape, and fails on a deliberately broken kernel."""

from __future__ import annotations

import pytest
import torch

from deterministic_inference.ops.native import NativeKernels
from deterministic_inference.ops.quant import FORMATS, TEST_BATCH_SCALE, TEST_REVERSE_ODD_THREADS
from deterministic_inference.ops.quant_probe import probe_quant_linear


@pytest.mark.parametrize("name", list(FORMATS))
def test_probe_passes_for_every_format(kernels: NativeKernels, name: str) -> None:
    result = probe_quant_linear(kernels, name, 96, 512, 2, torch.bfloat16, torch.Generator().manual_seed(0))
    assert result.ok, result.detail
    assert result.op == "quant_linear" and result.shape == f"{name} [96, 512]"


def test_probe_fails_on_a_batch_wide_activation_scale(kernels: NativeKernels) -> None:
    result = probe_quant_linear(
        kernels,
        "Q4_K",
        96,
        512,
        1,
        torch.float32,
        torch.Generator().manual_seed(1),
        test_flags=TEST_BATCH_SCALE,
    )
    assert not result.ok and result.detail.startswith("M=")


def test_probe_fails_on_a_thread_dependent_order(kernels: NativeKernels) -> None:
    """Odd threads adding the blocks in the other order: only a 2-thread probe can see it."""
    probe = dict(test_flags=TEST_REVERSE_ODD_THREADS)
    result = probe_quant_linear(
        kernels, "Q8_0", 512, 1024, 2, torch.bfloat16, torch.Generator().manual_seed(2), **probe
    )
    assert not result.ok
