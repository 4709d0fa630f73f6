"""What an architecture family declares: the block class that wires the shared blocks, and what its files
hold beyond the Llama layout. Each family's module (model/llama.py, model/phi3.py, model/gemma.py) holds
one `Family`; model/families.py finds it by architecture name."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from deterministic_inference.model.block import DecoderLayer
from deterministic_inference.ops.weights import StoredWeight

# (config.json path, its object, architecture) -> ModelSpec fields, rope_theta and rope_scaling included
HFFields = Callable[[Path, dict[str, Any], str], dict[str, Any]]
# (file path, GGUF metadata, architecture, head_dim, layers) -> ModelSpec fields
GGUFFields = Callable[[Path, dict[str, Any], str, int, int], dict[str, Any]]


@dataclass(frozen=True)
class Family:
    """One architecture family (see the module docstring). Defaults describe the Llama block's files."""

    name: str  # e.g. "gemma"
    architectures: tuple[str, ...]  # the ModelSpec.architecture names it serves
    layer: type[DecoderLayer]  # each decoder layer's block: wiring and the tensors it reads
    scaled_embedding: bool = False  # the embedding multiplied by sqrt(hidden) in the model dtype (Gemma)
    block_ops: tuple[str, ...] = ()  # ops beyond the Llama block's that the fingerprint names (model_ops)
    # GGUF block tensor (after blk.N.) -> HF name under model.layers.N., where it differs from llama.cpp's
    # Llama mapping (model/gguf_loader.py)
    gguf_layer_names: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # the spec fields of an HF config, in place of the Llama reading of rope and activation (None: that)
    hf_fields: HFFields | None = None
    gguf_fields: GGUFFields | None = None  # extra spec fields of a GGUF file (None: none)
    # (architecture, layers) -> which layers are windowed when the file does not say (None: all or none)
    window_layers: Callable[[str, int], tuple[bool, ...]] | None = None
    # in-place conversion of HF-directory weights to what the block computes with (None: as stored)
    convert_hf_weights: Callable[[dict[str, StoredWeight]], None] | None = None
