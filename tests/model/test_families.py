"""The architecture registry (model/families.py): every architecture the loaders produce has exactly one
family, and each family's block reads exactly the tensors its loaders are made to expect."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deterministic_inference.errors import UnsupportedArchitectureError
from deterministic_inference.model.block import DecoderLayer
from deterministic_inference.model.decoder import DecoderModel, Numerics
from deterministic_inference.model.families import (
    BY_ARCHITECTURE,
    FAMILIES,
    SUPPORTED_ARCHITECTURES,
    family_of,
)
from deterministic_inference.model.gemma import GemmaLayer
from deterministic_inference.model.hf_loader import _ARCHITECTURES as HF_ARCHITECTURES
from deterministic_inference.model.loader import expected_shapes, load_model
from deterministic_inference.model.moe_loading import GGUF_ARCHITECTURES
from deterministic_inference.model.phi3 import Phi3Layer
from deterministic_inference.ops.backend import select_backend
from tests.arch_models import build_arch_hf

# test architecture -> (our architecture, the block class its family wires)
BLOCKS = {"mistral": ("llama", DecoderLayer), "phi3": ("phi3", Phi3Layer), "gemma3": ("gemma3", GemmaLayer)}


def test_every_loaded_architecture_has_exactly_one_family() -> None:
    declared = [architecture for family in FAMILIES for architecture in family.architectures]
    assert len(declared) == len(set(declared)) == len(BY_ARCHITECTURE)  # no architecture in two families
    from_files = set(HF_ARCHITECTURES.values()) | {ours for ours, _ in GGUF_ARCHITECTURES.values()}
    assert from_files == set(SUPPORTED_ARCHITECTURES)
    for architecture in SUPPORTED_ARCHITECTURES:
        assert architecture in family_of(architecture).architectures


def test_unknown_architecture_is_refused_naming_the_supported_ones() -> None:
    with pytest.raises(UnsupportedArchitectureError, match="'mamba' is not supported; supported: llama, "):
        family_of("mamba")


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_each_family_block_reads_exactly_its_expected_tensors(name: str, tmp_path: Path) -> None:
    loaded = load_model(str(build_arch_hf(tmp_path / name, name).path))
    architecture, block = BLOCKS[name]
    assert loaded.spec.architecture == architecture
    model = DecoderModel(loaded.spec, loaded.weights, Numerics(torch.float32, False, 8), 64)
    assert {type(layer) for layer in model.layers} == {block}
    read = set(model.weight_formats) - {"lm_head.weight"}  # the tied head's entry names the embedding
    assert read == set(expected_shapes(loaded.spec)) - {"lm_head.weight"}


def test_another_family_block_does_not_fit(tmp_path: Path) -> None:
    """Negative control: the wiring comes from the family. The Llama block on Phi-3's fused tensors finds
    no q_proj, and the Llama block's tensor list misses Gemma's feed-forward norms."""
    phi3 = load_model(str(build_arch_hf(tmp_path / "phi3", "phi3").path))
    ops = select_backend(Numerics(torch.float32, False, 8))
    assert Phi3Layer(phi3.spec, phi3.weights, 0, ops).qkv.out_features > 0
    with pytest.raises(KeyError, match="q_proj"):
        DecoderLayer(phi3.spec, phi3.weights, 0, ops)
    gemma = load_model(str(build_arch_hf(tmp_path / "gemma3", "gemma3").path))
    llama_names = set(DecoderLayer.layer_shapes(gemma.spec, 0))
    assert set(GemmaLayer.layer_shapes(gemma.spec, 0)) - llama_names == {
        "model.layers.0.pre_feedforward_layernorm.weight",
        "model.layers.0.post_feedforward_layernorm.weight",
    }
