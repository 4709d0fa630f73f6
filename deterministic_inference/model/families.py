"""The architecture registry: architecture name -> its family (model/family.py).

Adding an architecture: give it a family module (model/<family>.py: its block class, if the shared
block (model/block.py) does not fit, and a `Family`), list it in FAMILIES below, and map its file names
to the architecture in the loaders (`_ARCHITECTURES` of model/hf_loader.py, `GGUF_ARCHITECTURES` of
model/moe_loading.py). docs/architecture.md has the whole recipe.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from deterministic_inference.errors import UnsupportedArchitectureError
from deterministic_inference.model.family import Family
from deterministic_inference.model.gemma import GEMMA
from deterministic_inference.model.llama import LLAMA
from deterministic_inference.model.phi3 import PHI3

FAMILIES: tuple[Family, ...] = (LLAMA, PHI3, GEMMA)
BY_ARCHITECTURE: Mapping[str, Family] = MappingProxyType(
    {architecture: family for family in FAMILIES for architecture in family.architectures}
)
SUPPORTED_ARCHITECTURES = tuple(BY_ARCHITECTURE)


def family_of(architecture: str) -> Family:
    """The family of `architecture` (a ModelSpec.architecture); UnsupportedArchitectureError naming the
    supported ones otherwise."""
    family = BY_ARCHITECTURE.get(architecture)
    if family is None:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported; supported: {supported}"
        )
    return family
