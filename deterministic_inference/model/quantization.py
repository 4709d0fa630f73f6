"""`--quantization`: which form each weight is computed in, applied once before the model is built.

- auto: weights as the loader stored them (GGUF blocks stay quantized; F32/F16/BF16 and safetensors
  are dense and computed in `--dtype`);
- none: every quantized weight dequantised to `--dtype` (one tensor at a time);
- q8_0: every dense float matrix whose rows are whole 32-value blocks quantized to Q8_0 (byte for byte
  what llama.cpp's quantizer writes for its values); quantized GGUF tensors stay as stored. Vectors
  (norms, biases) stay dense.
"""

from __future__ import annotations

import torch

from deterministic_inference.ops.quant import quantize_q8_0
from deterministic_inference.ops.weights import StoredWeight, dense, is_quantized


def apply_quantization(
    weights: dict[str, StoredWeight], quantization: str, dtype: torch.dtype
) -> dict[str, StoredWeight]:
    """The weights in the form `quantization` asks for (a new dict; the loader's stays untouched)."""
    if quantization == "auto":
        return dict(weights)
    if quantization == "none":
        return {name: dense(w, dtype) if is_quantized(w) else w for name, w in weights.items()}
    if quantization == "q8_0":
        return {name: _q8_0(w) for name, w in weights.items()}
    raise ValueError(f"quantization: {quantization!r} is not auto, none or q8_0")


def _q8_0(weight: StoredWeight) -> StoredWeight:
    """Dense [N, K] float matrices with K % 32 == 0 -> Q8_0; everything else unchanged."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] % 32:
        return weight
    return quantize_q8_0(weight)
