"""Mixture-of-experts pieces of the loaders: the spec fields from an HF config or GGUF metadata, the
tensor names of each layout mapped to the HF names of `model_spec.py`, and the expected weight shapes.

Layouts read:
- HF per-expert tensors (checkpoints on the hub): `mlp.experts.{e}.{gate,up,down}_proj.weight`
  (Qwen2/3-MoE), `block_sparse_moe.gate.weight` and `block_sparse_moe.experts.{e}.w1/w3/w2.weight`
  (Mixtral: gate, up, down);
- HF fused tensors (transformers 5 in memory): `mlp.experts.gate_up_proj` [E, 2I, H] and
  `mlp.experts.down_proj` [E, H, I], split into per-expert views;
- GGUF: `ffn_gate_inp` (router), 3-D `ffn_{gate,up,down}_exps` [E, rows, cols] (each expert's 2-D
  weight a view on the memory map, quantized blocks kept as stored), older per-expert
  `ffn_{gate,up,down}.{e}`, and the shared expert's `ffn_*_shexp`, `ffn_gate_inp_shexp`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from deterministic_inference.errors import ModelLoadError
from deterministic_inference.model_spec import ModelSpec
from deterministic_inference.ops.weights import StoredWeight

# GGUF general.architecture -> (our architecture, whether llama.cpp stores its q/k rows permuted)
GGUF_ARCHITECTURES = {
    "llama": ("llama", True),
    "qwen2": ("qwen2", False),
    "qwen3": ("qwen3", False),
    "qwen2moe": ("qwen2_moe", False),
    "qwen3moe": ("qwen3_moe", False),
    "phi3": ("phi3", False),
    "gemma3": ("gemma3", False),
    "gemma2": ("gemma2", False),
}
_PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
GGUF_MOE_LAYER = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    **{f"ffn_{p}_exps.weight": f"mlp.experts.{{e}}.{hf}.weight" for p, hf in _PROJ.items()},
    **{f"ffn_{p}_shexp.weight": f"mlp.shared_expert.{hf}.weight" for p, hf in _PROJ.items()},
}
_GGUF_PER_EXPERT = re.compile(r"^ffn_(gate|up|down)\.(\d+)\.weight$")
_HF_MIXTRAL = re.compile(
    r"^(model\.layers\.\d+\.)block_sparse_moe\.(gate\.weight|experts\.(\d+)\.w([123])\.weight)$"
)
_HF_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)$")
_MIXTRAL_W = {"1": "gate_proj", "3": "up_proj", "2": "down_proj"}


def gguf_moe_name(rest: str) -> str | None:
    """HF name (under model.layers.N.) of a GGUF layer tensor `rest` of an MoE model, "{e}" standing for
    the expert of a 3-D tensor; None when it is not an MoE tensor."""
    if rest in GGUF_MOE_LAYER:
        return GGUF_MOE_LAYER[rest]
    match = _GGUF_PER_EXPERT.match(rest)
    if match:
        return f"mlp.experts.{match.group(2)}.{_PROJ[match.group(1)]}.weight"
    return None


def split_experts(tensor: StoredWeight | tuple[StoredWeight, ...], target: str) -> dict[str, StoredWeight]:
    """{HF name: weight} for a tensor: a 3-D stack of experts (a tuple of per-expert 2-D views) under
    `target`'s "{e}"; the shared expert's gate vector [H] as [1, H]; anything else as it is."""
    if isinstance(tensor, tuple):
        if "{e}" not in target:
            raise ValueError(f"a stack of experts cannot be stored as {target}")
        return {target.format(e=e): weight for e, weight in enumerate(tensor)}
    if (
        target.endswith("shared_expert_gate.weight")
        and isinstance(tensor, torch.Tensor)
        and tensor.dim() == 1
    ):
        return {target: tensor.reshape(1, -1)}
    return {target: tensor}


def gguf_moe_fields(
    path: Path, meta: dict[str, Any], arch: str, prefix: str, tensors: dict[str, Any]
) -> dict[str, Any]:
    """The MoE fields of a GGUF file's spec ({} for a dense model). `prefix` is the metadata key prefix
    (general.architecture); `tensors` the file's tensors by GGUF name (3-D stacks as tuples)."""
    experts = int(meta.get(f"{prefix}.expert_count", 0) or 0)
    if experts == 0:
        return {}
    used = meta.get(f"{prefix}.expert_used_count")
    if used is None:
        raise ModelLoadError(f"{path}: GGUF metadata {prefix}.expert_used_count is missing")
    gate = tensors.get("blk.0.ffn_gate_exps.weight")
    width = meta.get(f"{prefix}.expert_feed_forward_length")
    if width is None:
        width = gate[0].shape[0] if isinstance(gate, tuple) else meta.get(f"{prefix}.feed_forward_length", 0)
    shared = meta.get(f"{prefix}.expert_shared_feed_forward_length")
    if shared is None and "blk.0.ffn_gate_shexp.weight" in tensors:
        shared = tensors["blk.0.ffn_gate_shexp.weight"].shape[0]
    # llama.cpp renormalises the chosen experts' weights for Mixtral and Qwen3-MoE, not for Qwen2-MoE
    norm = meta.get(f"{prefix}.expert_weights_norm", arch != "qwen2_moe")
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(used),
        "moe_intermediate_size": int(width),
        "norm_topk_prob": bool(norm),
        "shared_expert_intermediate_size": int(shared or 0),
    }


def hf_moe_fields(config_path: Path, config: dict[str, Any], arch: str) -> dict[str, Any]:
    """The MoE fields of an HF config's spec ({} for a dense architecture); ModelLoadError for layouts
    not supported (dense layers between MoE layers)."""
    if arch not in ("qwen2_moe", "qwen3_moe", "mixtral"):
        return {}

    def field(key: str, alias: str = "") -> int:
        value = config.get(key, config.get(alias))
        if value is None:
            raise ModelLoadError(f"{config_path}: field {key} is missing")
        return int(value)

    if arch == "mixtral":
        return {
            "num_experts": field("num_local_experts", "num_experts"),
            "num_experts_per_tok": field("num_experts_per_tok"),
            "moe_intermediate_size": field("intermediate_size"),
            "norm_topk_prob": True,
        }
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1)) != 1:
        raise ModelLoadError(
            f"{config_path}: dense MLP layers between mixture-of-experts layers (mlp_only_layers, "
            "decoder_sparse_step) are not supported"
        )
    return {
        "num_experts": field("num_experts", "num_local_experts"),  # transformers 5 writes the latter
        "num_experts_per_tok": field("num_experts_per_tok"),
        "moe_intermediate_size": field("moe_intermediate_size"),
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        "shared_expert_intermediate_size": int(config.get("shared_expert_intermediate_size") or 0)
        if arch == "qwen2_moe"
        else 0,
    }


def hf_moe_weights(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """An HF checkpoint tensor under the names of model_spec.py: Mixtral's block_sparse_moe names renamed,
    transformers 5's fused expert stacks split into per-expert views; other tensors unchanged."""
    match = _HF_MIXTRAL.match(name)
    if match:
        prefix, rest, expert, which = match.groups()
        if expert is None:
            return {f"{prefix}mlp.gate.weight": tensor}
        return {f"{prefix}mlp.experts.{expert}.{_MIXTRAL_W[which]}.weight": tensor}
    match = _HF_FUSED.match(name)
    if match and tensor.dim() == 3:
        prefix, kind = match.groups()
        if kind == "down_proj":
            return {f"{prefix}{e}.down_proj.weight": tensor[e] for e in range(tensor.shape[0])}
        inter = tensor.shape[1] // 2
        out = {}
        for e in range(tensor.shape[0]):
            out[f"{prefix}{e}.gate_proj.weight"] = tensor[e, :inter]
            out[f"{prefix}{e}.up_proj.weight"] = tensor[e, inter:]
        return out
    return {name: tensor}


def moe_shapes(spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
    """Every MLP weight of MoE layer `layer` with its shape."""
    p, hidden = f"model.layers.{layer}.mlp.", spec.hidden_size
    shapes: dict[str, tuple[int, ...]] = {p + "gate.weight": (spec.num_experts, hidden)}
    groups = [(f"experts.{e}.", spec.moe_intermediate_size) for e in range(spec.num_experts)]
    if spec.shared_expert_intermediate_size:
        groups.append(("shared_expert.", spec.shared_expert_intermediate_size))
        shapes[p + "shared_expert_gate.weight"] = (1, hidden)
    for group, inter in groups:
        shapes[f"{p}{group}gate_proj.weight"] = (inter, hidden)
        shapes[f"{p}{group}up_proj.weight"] = (inter, hidden)
        shapes[f"{p}{group}down_proj.weight"] = (hidden, inter)
    return shapes


def check_moe_spec(where: Path, spec: ModelSpec) -> None:
    """ModelLoadError unless the MoE hyper-parameters make sense."""
    if not spec.is_moe:
        return
    if not 1 <= spec.num_experts_per_tok <= spec.num_experts or spec.num_experts > 4096:
        raise ModelLoadError(
            f"{where}: {spec.num_experts_per_tok} experts per token of {spec.num_experts} is not supported "
            "(need 1 <= experts per token <= experts <= 4096)"
        )
    if spec.moe_intermediate_size <= 0:
        raise ModelLoadError(
            f"{where}: the experts' intermediate size {spec.moe_intermediate_size} is not positive"
        )
