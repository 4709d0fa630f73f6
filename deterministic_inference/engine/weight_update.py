"""New weights for a running engine (the RL weight push): checked, swapped between requests, fingerprinted.

`swap_weights` is what `Engine.update_weights` does: refuse while requests are in flight (they must finish
on the weights they started with; the server waits for them, see server/weights_route.py), check that
the new tensors are exactly the served model's (names, shapes, float dtypes), build a new decoder from
them with the engine's numerics (the same build as at start-up), then swap it in, flush the prefix cache
(cached KV was computed by the old weights) and change the fingerprint: its model digest becomes
`weights_digest` of the tensors as the engine computes them (its dtype). Nothing changes until every check
and the build succeeded, so a refused update leaves the old weights serving.

`read_weights_dir` reads an SGLang-style `update_weights_from_disk` directory (*.safetensors, HF names).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from deterministic_inference import fingerprint
from deterministic_inference.engine.setup import DTYPES, build_model
from deterministic_inference.errors import DetinfError, InvalidRequestError, ModelLoadError
from deterministic_inference.model.families import family_of
from deterministic_inference.model.hf_loader import load_safetensors_weights
from deterministic_inference.model.loader import expected_shapes
from deterministic_inference.model_spec import ModelSpec

if TYPE_CHECKING:
    from deterministic_inference.engine.engine import Engine

logger = logging.getLogger("detinf.engine")


class EngineBusyError(DetinfError):
    """Weights cannot change while requests are in flight; finish or abort them first."""


def weights_digest(weights: Mapping[str, torch.Tensor]) -> str:
    """``sha256:<hex>`` over the tensors in name order: each name, dtype, shape and raw bytes."""
    outer = hashlib.sha256()
    for name in sorted(weights):
        tensor = weights[name].detach().contiguous()
        outer.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\n".encode())
        outer.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return "sha256:" + outer.hexdigest()


def check_weights(weights: Mapping[str, object], spec: ModelSpec, param: str) -> dict[str, torch.Tensor]:
    """The weights `spec` needs, by name (a tied model's lm_head.weight is ignored, as the loaders do),
    when they are exactly that set of floating-point tensors with the right shapes; else
    InvalidRequestError naming `param`, the first offending tensor and what was expected."""
    expected = expected_shapes(spec)
    given = dict(weights)
    if spec.tie_word_embeddings:
        given.pop("lm_head.weight", None)
    missing, extra = sorted(set(expected) - set(given)), sorted(set(given) - set(expected))
    if missing or extra:
        raise InvalidRequestError(
            f"{param}: the weights do not match the served model: missing {missing[:5]}, unexpected "
            f"{extra[:5]}; give every tensor of the model under its Hugging Face name",
            param=param,
        )
    checked: dict[str, torch.Tensor] = {}
    for name, shape in expected.items():
        tensor = given[name]
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise InvalidRequestError(f"{param}: {name} is not a floating-point tensor", param=param)
        if tuple(tensor.shape) != shape:
            raise InvalidRequestError(
                f"{param}: {name} has shape {tuple(tensor.shape)}, the served model needs {shape}", param
            )
        checked[name] = tensor
    return checked


def read_weights_dir(path: str, param: str = "model_path") -> dict[str, torch.Tensor]:
    """Every tensor of the *.safetensors files in directory `path` (or of the shards its
    model.safetensors.index.json names), under HF names; InvalidRequestError naming `param` when the
    directory is missing or holds no readable weights (the message names no server path)."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise InvalidRequestError(
            f"{param}: no such directory on the server; give a directory holding *.safetensors weights",
            param=param,
        )
    try:
        weights, _ = load_safetensors_weights(directory)
    except ModelLoadError as error:
        logger.warning("update_weights: cannot read %s: %s", directory, error)
        raise InvalidRequestError(
            f"{param}: the directory holds no readable safetensors weights (missing, corrupt or "
            "incomplete files; the server log has the details)",
            param=param,
        ) from None
    return weights


def swap_weights(engine: Engine, weights: Mapping[str, torch.Tensor], param: str) -> str:
    """See the module docstring; returns the new system_fingerprint."""
    if engine.has_unfinished:
        raise EngineBusyError(
            f"update_weights: {engine.num_unfinished_requests} requests are still in flight; let them "
            "finish (or abort them) before changing the weights"
        )
    if family_of(engine.spec.architecture).convert_hf_weights is not None:
        # the loader converts this family's HF weights (Gemma: norms as 1 + w); an update does not yet
        raise InvalidRequestError(
            f"{param}: weight updates are not supported for {engine.spec.architecture} models", param=param
        )
    dtype = DTYPES[engine.dtype_name]
    # as the engine computes them: its dtype, contiguous
    dense = {
        name: t.detach().to(dtype).contiguous()
        for name, t in check_weights(weights, engine.spec, param).items()
    }
    loaded = dataclasses.replace(engine.loaded, weights=dict(dense))
    model = build_model(loaded, engine.config, engine.dtype_name, engine.max_model_len)
    digest = weights_digest(dense)
    # every check and the build passed: swap
    engine.loaded, engine.model, engine.runner.model, engine.model_digest = loaded, model, model, digest
    engine.fingerprint = fingerprint.engine_fingerprint(
        digest,
        engine.config.numerics(engine.dtype_name, model.weight_formats, model.model_ops),
        portable=model.ops.portable,
    )
    engine.system_fingerprint = fingerprint.system_fingerprint(engine.fingerprint)
    engine.kv.hash_extra = engine.system_fingerprint  # prefix-cache keys carry the fingerprint
    flushed = engine.flush_prefix_cache()
    logger.info(
        "weights updated (%s): system_fingerprint %s, %d prefix-cache blocks flushed",
        digest[:23],
        engine.system_fingerprint,
        flushed,
    )
    return engine.system_fingerprint
