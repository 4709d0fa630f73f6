"""`load_model`: one entry point for GGUF files, HF directories and the embedded default model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from deterministic_inference.errors import ModelLoadError
from deterministic_inference.model.default_model import DEFAULT_MODEL_NAME, default_model_path
from deterministic_inference.model.families import family_of
from deterministic_inference.model.gguf_choice import choose_gguf
from deterministic_inference.model.gguf_loader import is_gguf_file, load_gguf
from deterministic_inference.model.hf_loader import load_hf
from deterministic_inference.model.moe_loading import check_moe_spec
from deterministic_inference.model.tokenizer import Tokenizer
from deterministic_inference.model_spec import ModelSpec
from deterministic_inference.ops.weights import StoredWeight


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for an architecture: hyper-parameters, weights as stored, tokenizer, provenance."""

    spec: ModelSpec
    # HF Llama-style names (see model_spec.py): dense or quantized, as stored
    weights: dict[str, StoredWeight]
    tokenizer: Tokenizer
    artifacts: tuple[Path, ...]  # every file read (weights, tokenizer, config), for digests
    source: str  # "gguf" or "hf"
    name: str  # default served model name


def load_model(path: str | None, quantization: str = "auto") -> LoadedModel:
    """Load a GGUF file or HF directory (None = the embedded default model); a directory without
    config.json holding one GGUF file loads that file (`gguf_choice`).

    The result depends only on the files' bytes: weights stay as stored (see the loaders); only GGUF
    block formats the kernels cannot read are dequantised, and only under `quantization` "none"."""
    if path is None:
        gguf_path = default_model_path()
        spec, weights, tokenizer, _ = load_gguf(gguf_path, quantization)
        return _checked(LoadedModel(spec, weights, tokenizer, (gguf_path,), "gguf", DEFAULT_MODEL_NAME))
    target = Path(path).expanduser()
    if target.is_dir():
        chosen = choose_gguf(target)  # a *-GGUF snapshot: its one GGUF (several: the error says how to pick)
        if chosen is None:
            spec, weights, tokenizer, artifacts = load_hf(target)
            return _checked(LoadedModel(spec, weights, tokenizer, artifacts, "hf", target.resolve().name))
        target = chosen
    if not target.exists():
        raise ModelLoadError(
            f"{target}: no such file or directory (expected a .gguf file or an HF directory)"
        )
    if not is_gguf_file(target):
        raise ModelLoadError(
            f"{target}: not a GGUF file (no GGUF magic bytes) and not a directory; pass a .gguf file "
            "or a Hugging Face model directory"
        )
    spec, weights, tokenizer, name = load_gguf(target, quantization)
    return _checked(LoadedModel(spec, weights, tokenizer, (target,), "gguf", name))


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every weight an architecture needs for `spec`, with its shape: the global tensors, then each layer's
    as its family's block reads them (`layer_shapes`)."""
    layer = family_of(spec.architecture).layer
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab_size, spec.hidden_size),
        "model.norm.weight": (spec.hidden_size,),
    }
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, spec.hidden_size)
    for index in range(spec.num_layers):
        shapes.update(layer.layer_shapes(spec, index))
    return shapes


def _checked(model: LoadedModel) -> LoadedModel:
    """ModelLoadError unless the weights are exactly the set the spec needs, with the right shapes."""
    where = model.artifacts[0].parent if model.source == "hf" else model.artifacts[0]
    spec = model.spec
    if spec.num_heads % spec.num_kv_heads != 0:
        raise ModelLoadError(
            f"{where}: {spec.num_heads} heads is not a multiple of {spec.num_kv_heads} kv heads"
        )
    check_moe_spec(where, spec)
    expected = expected_shapes(spec)
    missing = sorted(set(expected) - set(model.weights))
    extra = sorted(set(model.weights) - set(expected))
    if missing or extra:
        raise ModelLoadError(
            f"{where}: weights do not match a {spec.architecture} model: missing {missing[:5]}, "
            f"unexpected {extra[:5]}"
        )
    for name, shape in expected.items():
        if tuple(model.weights[name].shape) != shape:
            raise ModelLoadError(
                f"{where}: weight {name} has shape {tuple(model.weights[name].shape)}, expected {shape}"
            )
    if model.tokenizer.vocab_size > spec.vocab_size:
        raise ModelLoadError(
            f"{where}: the tokenizer has {model.tokenizer.vocab_size} tokens but the model only "
            f"{spec.vocab_size} embeddings"
        )
    return model
