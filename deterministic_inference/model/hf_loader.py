"""Load a Hugging Face model directory: config.json, *.safetensors, tokenizer.json and friends."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers
import torch

from deterministic_inference.errors import ModelLoadError, UnsupportedArchitectureError
from deterministic_inference.model.families import SUPPORTED_ARCHITECTURES, family_of
from deterministic_inference.model.moe_loading import hf_moe_fields, hf_moe_weights
from deterministic_inference.model.rope_config import hf_rope_scaling, scaled_context
from deterministic_inference.model.spm_tokenizer import sentencepiece_file_backend
from deterministic_inference.model.tokenizer import Tokenizer, end_of_turn_ids
from deterministic_inference.model_spec import ModelSpec, RopeScaling
from deterministic_inference.ops.weights import StoredWeight

# model_type / architectures[0] -> our architecture
_ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "phi3": "phi3",
    "Phi3ForCausalLM": "phi3",
    "gemma3_text": "gemma3",
    "Gemma3ForCausalLM": "gemma3",
    "gemma2": "gemma2",
    "Gemma2ForCausalLM": "gemma2",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}


def read_optional_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`, None when the file does not exist; ModelLoadError when malformed."""
    if not path.is_file():
        return None
    return read_json(path)


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; ModelLoadError when it is missing or malformed."""
    if not path.is_file():
        raise ModelLoadError(f"{path}: file is missing")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def load_hf(path: Path) -> tuple[ModelSpec, dict[str, StoredWeight], Tokenizer, tuple[Path, ...]]:
    """(spec, weights as stored (fp32/bf16/fp16), tokenizer, files read) from the HF directory at `path`."""
    config_path = path / "config.json"
    config = read_json(config_path)
    arch = _architecture(config_path, config)
    weight_files = _weight_files(path)
    weights: dict[str, StoredWeight] = dict(_load_weights(weight_files))
    tokenizer, tokenizer_files = _load_tokenizer(path, config)
    spec = _spec(config_path, config, arch, weights, tokenizer)
    convert = family_of(arch).convert_hf_weights
    if convert is not None:  # Gemma: its norm weights w as the 1 + w the block multiplies by
        convert(weights)
    if spec.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    elif "lm_head.weight" not in weights:
        raise ModelLoadError(
            f"{path}: lm_head.weight is missing and config.json says tie_word_embeddings is false"
        )
    artifacts = (config_path, *weight_files, *tokenizer_files)
    return spec, weights, tokenizer, tuple(sorted(set(artifacts)))


def _architecture(config_path: Path, config: dict[str, Any]) -> str:
    names = [config.get("model_type"), *(config.get("architectures") or [])]
    for name in names:
        if isinstance(name, str) and name in _ARCHITECTURES:
            return _ARCHITECTURES[name]
    shown = config.get("model_type") or (config.get("architectures") or [None])[0]
    raise UnsupportedArchitectureError(
        f"{config_path}: architecture {shown!r} is not supported; supported: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)} (HF model types: llama, mistral, qwen2, qwen3, qwen2_moe, "
        "qwen3_moe, mixtral, phi3, gemma3_text, gemma2)"
    )


def _field(config_path: Path, config: dict[str, Any], key: str, default: Any = None) -> Any:
    value = config.get(key, default)
    if value is None:
        raise ModelLoadError(f"{config_path}: field {key} is missing")
    return value


def _rope(config_path: Path, config: dict[str, Any], head_dim: int) -> tuple[float, RopeScaling | None]:
    """rope_theta and scaling, from transformers-5 `rope_parameters` or older top-level keys."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    return theta, hf_rope_scaling(config_path, config, scaling, head_dim)


def _sliding_window(
    config_path: Path, config: dict[str, Any], layers: int, max_positions: int
) -> tuple[int, tuple[bool, ...]]:
    """(window, which layers are windowed; () = all) as transformers reads them: `sliding_window` where
    the family uses it (Qwen only under use_sliding_window), per layer from `layer_types` or Qwen's
    `max_window_layers`. A window no sequence can cross (>= max_position_embeddings) is no window."""
    window = config.get("sliding_window")
    qwen = str(config.get("model_type", "")).startswith("qwen")
    if not isinstance(window, int) or window <= 0 or window >= max_positions:
        return 0, ()
    if qwen and not config.get("use_sliding_window"):
        return 0, ()
    types = config.get("layer_types")
    if isinstance(types, list):
        if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
            raise ModelLoadError(
                f"{config_path}: layer_types must list {layers} sliding/full attention layers"
            )
        return window, tuple(t == "sliding_attention" for t in types)
    if qwen:
        first = int(config.get("max_window_layers", 0))
        return window, tuple(i >= first for i in range(layers))
    return window, ()


def _check_variant(config_path: Path, config: dict[str, Any]) -> None:
    """Refuse the variants the decoder does not implement: another MLP activation, partial rotary."""
    activation = config.get("hidden_act", "silu")
    if activation not in (None, "silu"):
        raise ModelLoadError(f"{config_path}: hidden_act {activation!r} is not supported (supported: silu)")
    params = config.get("rope_parameters") or {}
    for partial in (params.get("partial_rotary_factor"), config.get("partial_rotary_factor")):
        if partial is not None and float(partial) != 1.0:
            raise ModelLoadError(
                f"{config_path}: partial_rotary_factor {partial} is not supported "
                "(rotary over whole heads only)"
            )


def _spec(
    config_path: Path,
    config: dict[str, Any],
    arch: str,
    weights: dict[str, StoredWeight],
    tokenizer: Tokenizer,
) -> ModelSpec:
    try:
        hidden = int(_field(config_path, config, "hidden_size"))
        heads = int(_field(config_path, config, "num_attention_heads"))
        max_positions = int(_field(config_path, config, "max_position_embeddings"))
        layers = int(_field(config_path, config, "num_hidden_layers"))
        head_dim = int(config.get("head_dim") or hidden // heads)
        family = family_of(arch)
        extra: dict[str, Any] = {}
        if family.hf_fields is not None:  # the family reads its own rope and activation keys (Gemma)
            extra = family.hf_fields(config_path, config, arch)
            theta, scaling = extra.pop("rope_theta"), extra.pop("rope_scaling")
        else:
            theta, scaling = _rope(config_path, config, head_dim)
            _check_variant(config_path, config)
        max_positions = scaled_context(max_positions, scaling)
        window, window_layers = _sliding_window(config_path, config, layers, max_positions)
        if family.window_layers is not None:  # a fixed pattern where the config gives none (Gemma)
            window_layers = window_layers or family.window_layers(arch, layers)
        return ModelSpec(
            architecture=arch,
            vocab_size=int(_field(config_path, config, "vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(_field(config_path, config, "intermediate_size")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", "lm_head.weight" not in weights)),
            attention_bias="model.layers.0.self_attn.q_proj.bias" in weights,
            qk_norm="model.layers.0.self_attn.q_norm.weight" in weights,
            rope_scaling=scaling,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_ids=tokenizer.eos_token_ids,
            sliding_window=window,
            window_layers=window_layers,
            **extra,
            **hf_moe_fields(config_path, config, arch),
        )
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        raise ModelLoadError(f"{config_path}: invalid hyper-parameter: {exc}") from exc


def load_safetensors_weights(path: Path) -> tuple[dict[str, torch.Tensor], list[Path]]:
    """(tensors, files read) of the *.safetensors weights in directory `path` (or the shards of its
    model.safetensors.index.json), read as `load_hf` reads them; ModelLoadError when there are none or a
    file is unreadable. Also the reader of a weight update (`engine/weight_update.py`)."""
    files = _weight_files(path)
    return _load_weights(files), files


def _weight_files(path: Path) -> list[Path]:
    index_path = path / "model.safetensors.index.json"
    index = read_optional_json(index_path)
    if index is not None:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index_path}: weight_map is missing or empty")
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index_path}: shard files are missing: {', '.join(missing)}")
        return [index_path, *files]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights (other formats are not supported)")
    return files


def _load_weights(files: list[Path]) -> dict[str, torch.Tensor]:
    """All tensors as contiguous CPU tensors in their stored float dtype (fp32, bf16, fp16; other dtypes
    as fp32: the model casts to --dtype when it is built); `model.` prefix added where a checkpoint
    omits it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in files:
        if file.suffix != ".safetensors":
            continue
        try:
            tensors = load_file(str(file), device="cpu")
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"{file}: not a readable safetensors file: {exc}") from exc
        for name, tensor in tensors.items():
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name.startswith(("layers.", "embed_tokens.", "norm.")):
                name = "model." + name
            if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                tensor = tensor.to(torch.float32)
            weights.update(hf_moe_weights(name, tensor.contiguous()))
    return weights


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template(path: Path, tok_config: dict[str, Any]) -> tuple[str | None, list[Path]]:
    jinja_path = path / "chat_template.jinja"
    if jinja_path.is_file():
        return jinja_path.read_text(encoding="utf-8"), [jinja_path]
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: use "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return (template if isinstance(template, str) else None), []


def _ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _load_tokenizer(path: Path, config: dict[str, Any]) -> tuple[Tokenizer, list[Path]]:
    tok_config_path = path / "tokenizer_config.json"
    tok_config = read_optional_json(tok_config_path) or {}
    backend, files, spm_ids = _tokenizer_backend(path, tok_config)
    if tok_config_path.is_file():
        files.append(tok_config_path)
    gen_path = path / "generation_config.json"
    gen_config = read_optional_json(gen_path) or {}
    if gen_path.is_file():
        files.append(gen_path)
    template, template_files = _template(path, tok_config)
    files += template_files

    bos_text = _token_text(tok_config.get("bos_token"))
    bos = backend.token_to_id(bos_text) if bos_text else None
    if bos is None:
        bos = next(iter(_ids(config.get("bos_token_id"))), spm_ids.get("bos"))
    eos_ids = set(_ids(gen_config.get("eos_token_id")) or _ids(config.get("eos_token_id")))
    eos_text = _token_text(tok_config.get("eos_token"))
    eos_from_text = backend.token_to_id(eos_text) if eos_text else None
    eos = eos_from_text if eos_from_text is not None else next(iter(sorted(eos_ids)), spm_ids.get("eos"))
    eos_ids |= {int(eos)} if eos is not None else set()
    eos_ids |= end_of_turn_ids(backend, template)
    add_bos = tok_config.get("add_bos_token")
    if add_bos is None:  # a SentencePiece model alone: Llama's tokenizer adds BOS
        add_bos = True if spm_ids else _post_processor_adds(backend, bos)
    tokenizer = Tokenizer(
        backend,
        bos_token_id=bos,
        eos_token_ids=sorted(eos_ids),
        add_bos=bool(add_bos),
        add_eos=bool(tok_config.get("add_eos_token", False)),
        eos_token_id=None if eos is None else int(eos),
        chat_template=template,
    )
    return tokenizer, files


def _tokenizer_backend(
    path: Path, tok_config: dict[str, Any]
) -> tuple[tokenizers.Tokenizer, list[Path], dict[str, int]]:
    """(backend, files read, SentencePiece bos/eos ids) from tokenizer.json, else from a SentencePiece
    tokenizer.model (built as llama.cpp tokenizes it, see `spm_tokenizer`)."""
    tok_path, spm_path = path / "tokenizer.json", path / "tokenizer.model"
    if tok_path.is_file():
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_path))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise ModelLoadError(f"{tok_path}: not a valid tokenizer.json: {exc}") from exc
        return backend, [tok_path], {}
    if spm_path.is_file():
        backend, spm_ids = sentencepiece_file_backend(spm_path, tok_config.get("add_prefix_space"))
        return backend, [spm_path], spm_ids
    raise ModelLoadError(
        f"{tok_path}: file is missing; a tokenizer.json (fast tokenizer) or a SentencePiece "
        "tokenizer.model is required"
    )


def _post_processor_adds(backend: tokenizers.Tokenizer, bos: int | None) -> bool:
    """Whether tokenizer.json's own post-processor prepends BOS (e.g. Llama 3 TemplateProcessing)."""
    if bos is None:
        return False
    ids = backend.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == bos
