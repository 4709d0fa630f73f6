"""Benchmark model maker: a random-weight GGUF of a given family, shape and weight format.

    python -m bench.make_gguf --out /tmp/llama1b-q4_0.gguf --qtype Q4_0
    python -m bench.make_gguf --out /tmp/small.gguf --qtype Q4_K_M --hidden 256 --layers 2 --heads 4 \
        --kv-heads 2 --ffn 512
    python -m bench.make_gguf --out /tmp/moe-q4_0.gguf --qtype Q4_0 --experts 8 --experts-used 2 --ffn 2048
    python -m bench.make_gguf --out /tmp/gemma3-1b-q8_0.gguf --arch gemma3 --qtype Q8_0

The default shape is Llama-3.2-1B's (hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192, tied
embeddings, rope base 500000) with the default model's tokenizer (every `tokenizer.*` key copied from
the embedded SmolLM2 GGUF, so the vocabulary is 49152). Both our engine and llama.cpp load the files.

`--arch {llama,mistral,gemma3,gemma2,phi3}` picks the family: its llama.cpp tensor layout and metadata
keys, and a preset shape (Mistral-7B, Gemma-3-1B, Gemma-2-2B, Phi-3-mini-4k; see `bench.gguf_families`).
The shape flags override the preset's values one by one. Every family keeps the default model's
tokenizer (not Gemma's or Phi-3's own vocabulary): enough for a file whose weights are random anyway,
and the compute per token differs from the real model's only in the embedding / output head size.

Formats: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K for every matrix (norms stay
F32), or the mixes Q4_K_M / Q5_K_M (see `format_plan`). The 32-value formats are quantized by the
`gguf` package, the K-quants by `bench.kquants`. Weights are Gaussian (std 0.02, norms 1 + 0.1 noise),
drawn per tensor from a generator seeded by (seed, tensor name): the same arguments give the same
bytes. Tensors are generated and written one at a time, so memory stays at about one tensor.

`--experts N --experts-used K` makes a Mixtral-style mixture of experts (llama.cpp's layout: arch
`llama` with `llama.expert_count` / `expert_used_count`, an F32 router `ffn_gate_inp` [N, hidden] and 3-D
stacks `ffn_{gate,up,down}_exps` [N, ffn, hidden] in the chosen format; `--ffn` is each expert's width).

The API is meant to be extended: `llama_tensors` and `llama_metadata` give the plain Llama parts,
`model_tensors` any per-layer layout, `write_gguf` writes any list of `TensorSpec` with any metadata;
`bench.gguf_families.write_family_gguf` writes one family.
"""

from __future__ import annotations

import argparse
import sys
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.kquants import quantize_k

FLOAT_TYPES = ("F32", "F16", "BF16")
BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # quantized by the gguf package
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")  # quantized by bench.kquants
MIXES = ("Q4_K_M", "Q5_K_M")
QTYPES = FLOAT_TYPES + BLOCK_TYPES + K_TYPES + MIXES

# llama.cpp's `general.file_type` (enum llama_ftype) for each choice
FILE_TYPES = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K": 15, "Q4_K_M": 15,
    "Q5_K": 17, "Q5_K_M": 17, "Q6_K": 18, "BF16": 32,
}  # fmt: skip


@dataclass(frozen=True)
class LlamaShape:
    """Hyper-parameters of a Llama model (default: Llama-3.2-1B's). `head_dim` 0 means hidden // heads."""

    hidden: int = 2048
    layers: int = 16
    heads: int = 32
    kv_heads: int = 8
    ffn: int = 8192
    head_dim: int = 0
    context: int = 8192
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = True
    experts: int = 0  # > 0: a mixture of experts (Mixtral layout), each expert `ffn` wide
    experts_used: int = 0  # experts per token
    sliding_window: int = 0  # > 0: `{arch}.attention.sliding_window` (Mistral, Gemma, Phi-3)

    @property
    def dim(self) -> int:
        """Width of one attention head."""
        return self.head_dim or self.hidden // self.heads

    def check(self) -> None:
        """Raise ValueError naming the field when the shape cannot make a model."""
        for name in ("hidden", "layers", "heads", "kv_heads", "ffn", "context"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"--heads {self.heads} must be a multiple of --kv-heads {self.kv_heads}")
        if not self.head_dim and self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} must be a multiple of --heads {self.heads}")
        if self.dim % 2:
            raise ValueError(f"the head width {self.dim} must be even (rotary pairs)")
        if self.experts < 0 or (self.experts and not 1 <= self.experts_used <= self.experts):
            raise ValueError(
                f"--experts-used {self.experts_used} must be between 1 and --experts {self.experts}"
            )
        if self.experts_used and not self.experts:
            raise ValueError("--experts-used needs --experts")
        if not 0 <= self.sliding_window < self.context:
            raise ValueError(
                f"--sliding-window {self.sliding_window} must be 0 (none) or below --context {self.context}"
            )


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write: GGUF name, numpy shape (rows last-dim-contiguous), format, and init."""

    name: str
    shape: tuple[int, ...]  # numpy order: [..., rows, cols]; GGUF stores it reversed
    fmt: str  # F32 / F16 / BF16 / a block format
    scale: float = 0.02  # std of the Gaussian weights
    offset: float = 0.0  # added after scaling (1.0 for norm weights)


# (layer, GGUF tensor name without the "blk.N." prefix; layer -1 for globals) -> format
FormatPlan = Callable[[int, str], str]


def use_more_bits(layer: int, layers: int) -> bool:
    """The layers llama.cpp's *_K_M recipes give more bits: the first and last eighth, every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def format_plan(qtype: str, layers: int, tie_embeddings: bool) -> FormatPlan:
    """The format of each tensor for `qtype`: norms F32; one format everywhere else, or for the mixes
    the shape of llama.cpp's *_K_M recipe: the output head (the embedding when tied) Q6_K, attn_v and
    ffn_down Q6_K in the `use_more_bits` layers, every other matrix Q4_K (Q5_K for Q5_K_M)."""
    if qtype not in QTYPES:
        raise ValueError(f"--qtype must be one of {', '.join(QTYPES)}, got {qtype!r}")

    def plan(layer: int, name: str) -> str:
        if name.endswith("norm.weight"):
            return "F32"
        if qtype not in MIXES:
            return qtype
        if name == "output.weight" or (name == "token_embd.weight" and tie_embeddings):
            return "Q6_K"
        down = ("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")
        if name in down and layer >= 0 and use_more_bits(layer, layers):
            return "Q6_K"
        return qtype[:4]

    return plan


# a layer's tensors: (GGUF name without the "blk.N." prefix, numpy shape)
LayerTensors = tuple[tuple[str, tuple[int, ...]], ...]


def llama_tensors(shape: LlamaShape, vocab: int, plan: FormatPlan) -> list[TensorSpec]:
    """The tensors of a Llama model in llama.cpp's names and order, formats from `plan`."""
    return model_tensors(shape, vocab, plan, llama_layer_tensors(shape))


def llama_layer_tensors(shape: LlamaShape) -> LayerTensors:
    """A Llama block's tensors: attention q, k, v, output, and the dense or Mixtral-expert MLP."""
    hidden, dim = shape.hidden, shape.dim
    return (
        ("attn_norm.weight", (hidden,)), ("attn_q.weight", (shape.heads * dim, hidden)),
        ("attn_k.weight", (shape.kv_heads * dim, hidden)), ("attn_v.weight", (shape.kv_heads * dim, hidden)),
        ("attn_output.weight", (hidden, shape.heads * dim)), ("ffn_norm.weight", (hidden,)),
        *_mlp_tensors(shape),
    )  # fmt: skip


def model_tensors(
    shape: LlamaShape, vocab: int, plan: FormatPlan, per_layer: LayerTensors
) -> list[TensorSpec]:
    """The embedding, final norm, output head (when untied), then `per_layer` for every layer; norms
    Gaussian around 1, routers F32, every other matrix in the format `plan` gives it."""
    hidden = shape.hidden
    specs = [TensorSpec("token_embd.weight", (vocab, hidden), plan(-1, "token_embd.weight"))]
    specs.append(TensorSpec("output_norm.weight", (hidden,), "F32", 0.1, 1.0))
    if not shape.tie_embeddings:
        specs.append(TensorSpec("output.weight", (vocab, hidden), plan(-1, "output.weight")))
    for layer in range(shape.layers):
        for name, dims in per_layer:
            norm = name.endswith("norm.weight")
            scale, offset = (0.1, 1.0) if norm else (0.02, 0.0)
            fmt = "F32" if name == "ffn_gate_inp.weight" else plan(layer, name)  # routers stay F32
            specs.append(TensorSpec(f"blk.{layer}.{name}", dims, fmt, scale, offset))
    return specs


def _mlp_tensors(shape: LlamaShape) -> LayerTensors:
    """A layer's MLP tensors: the dense gated MLP, or the router and the 3-D expert stacks."""
    hidden, ffn, experts = shape.hidden, shape.ffn, shape.experts
    if not experts:
        return (
            ("ffn_gate.weight", (ffn, hidden)), ("ffn_up.weight", (ffn, hidden)),
            ("ffn_down.weight", (hidden, ffn)),
        )  # fmt: skip
    return (
        ("ffn_gate_inp.weight", (experts, hidden)), ("ffn_gate_exps.weight", (experts, ffn, hidden)),
        ("ffn_up_exps.weight", (experts, ffn, hidden)), ("ffn_down_exps.weight", (experts, hidden, ffn)),
    )  # fmt: skip


def llama_metadata(shape: LlamaShape, arch: str, qtype: str) -> dict[str, Any]:
    """Hyper-parameter keys (`{arch}.*`) and file-level keys; plain Python values, typed on write."""
    moe = {f"{arch}.expert_count": shape.experts, f"{arch}.expert_used_count": shape.experts_used}
    window = {f"{arch}.attention.sliding_window": shape.sliding_window}
    return {
        "general.name": f"random-{arch}-{shape.layers}L-{shape.hidden}-{qtype}",
        "general.file_type": FILE_TYPES.get(qtype, 1),
        "general.quantization_version": 2,
        f"{arch}.block_count": shape.layers,
        f"{arch}.context_length": shape.context,
        f"{arch}.embedding_length": shape.hidden,
        f"{arch}.feed_forward_length": shape.ffn,
        f"{arch}.attention.head_count": shape.heads,
        f"{arch}.attention.head_count_kv": shape.kv_heads,
        f"{arch}.attention.key_length": shape.dim,
        f"{arch}.attention.value_length": shape.dim,
        f"{arch}.rope.dimension_count": shape.dim,
        f"{arch}.rope.freq_base": float(shape.rope_theta),
        f"{arch}.attention.layer_norm_rms_epsilon": float(shape.rms_eps),
        **(moe if shape.experts else {}),
        **(window if shape.sliding_window else {}),
    }


def default_tokenizer_source() -> Path:
    """The embedded default model's GGUF (its tokenizer metadata is copied)."""
    from deterministic_inference.model.default_model import default_model_path

    return default_model_path()


@dataclass
class TokenizerFields:
    """The `tokenizer.*` metadata of a GGUF file (plain Python values) and its vocabulary size."""

    fields: dict[str, Any] = field(default_factory=dict)
    vocab: int = 0


def read_tokenizer_fields(path: Path) -> TokenizerFields:
    """Every `tokenizer.*` key of the GGUF at `path`, in file order (read with the engine's header
    reader: the `gguf` package's reader takes ~10 s over a 49k-token vocabulary)."""
    from deterministic_inference.model.gguf_file import StringArray, read_gguf

    meta = read_gguf(path).metadata
    fields = {
        key: list(value) if isinstance(value, StringArray) else value
        for key, value in meta.items()
        if key.startswith("tokenizer.")
    }
    tokens = fields.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ValueError(f"{path}: no tokenizer.ggml.tokens to copy")
    return TokenizerFields(fields, len(tokens))


def tensor_bytes(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    """Random values for `spec`, encoded in its format: [..., row_bytes] uint8."""
    import gguf

    noise = rng.standard_normal(spec.shape, dtype=np.float32)
    values = noise * np.float32(spec.scale) + np.float32(spec.offset)
    if spec.fmt in K_TYPES:
        return quantize_k(values, spec.fmt)
    qtype = gguf.GGMLQuantizationType[spec.fmt]
    encoded = gguf.quants.quantize(values, qtype)
    return np.ascontiguousarray(encoded).view(np.uint8).reshape(*spec.shape[:-1], -1)


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    """A generator of its own per (seed, tensor name): a tensor's values do not depend on the others."""
    return np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(name.encode())]))


def write_gguf(
    path: Path, arch: str, metadata: dict[str, Any], tensors: Sequence[TensorSpec], seed: int,
    tokenizer: TokenizerFields,
) -> Path:  # fmt: skip
    """Write a GGUF: `metadata` (ints as uint32, floats as float32, strings), the tokenizer fields,
    then each tensor drawn and encoded in turn. The file is written to a temporary name and renamed,
    so a failure leaves no half-written file at `path`."""
    import gguf

    for spec in tensors:
        check_tensor(spec)
    tmp = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp), arch)
    try:
        for key, value in metadata.items():
            _add_value(writer, key, value)
        for key, value in tokenizer.fields.items():
            _add_value(writer, key, value)
        for spec in tensors:
            qtype = gguf.GGMLQuantizationType[spec.fmt]
            block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = (*spec.shape[:-1], spec.shape[-1] // block_values * block_bytes)
            nbytes = int(np.prod(byte_shape))
            writer.add_tensor_info(spec.name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for spec in tensors:
            writer.write_tensor_data(tensor_bytes(spec, tensor_rng(seed, spec.name)))
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    writer.close()
    tmp.replace(path)
    return path


def check_tensor(spec: TensorSpec) -> None:
    """Raise ValueError naming the tensor when its rows do not split into its format's blocks."""
    import gguf

    block_values = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[spec.fmt]][0]
    if spec.shape[-1] % block_values:
        raise ValueError(
            f"tensor {spec.name} has rows of {spec.shape[-1]} values, not a multiple of {spec.fmt}'s "
            f"block of {block_values}: pick a shape whose widths are multiples of {block_values}"
        )


def _add_value(writer: Any, key: str, value: Any) -> None:
    """Typed as llama.cpp writes these keys: integers uint32 (ids, counts), integer arrays int32
    (tokenizer.ggml.token_type), floats float32."""
    import gguf

    if isinstance(value, list):
        if value and all(isinstance(v, str) for v in value):
            writer.add_array(key, value)
        elif all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
        else:
            raise TypeError(f"metadata {key}: unsupported array contents")
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        raise TypeError(f"metadata {key}: unsupported value type {type(value).__name__}")


def write_llama_gguf(
    path: Path | str,
    shape: LlamaShape = LlamaShape(),
    qtype: str = "Q4_0",
    seed: int = 0,
    arch: str = "llama",
    extra: dict[str, Any] | None = None,
    tokenizer_source: Path | None = None,
) -> Path:
    """Write a random-weight Llama GGUF of `shape` in `qtype` to `path` (deterministic for the
    arguments); `extra` adds or overrides metadata keys. Returns the path."""
    shape.check()
    plan = format_plan(qtype, shape.layers, shape.tie_embeddings)
    tokenizer = read_tokenizer_fields(tokenizer_source or default_tokenizer_source())
    metadata = llama_metadata(shape, arch, qtype)
    metadata.update(extra or {})
    tensors = llama_tensors(shape, tokenizer.vocab, plan)
    return write_gguf(Path(path), arch, metadata, tensors, seed, tokenizer)


SHAPE_FLAGS = ("hidden", "layers", "heads", "kv_heads", "ffn", "head_dim", "context", "sliding_window")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from bench.gguf_families import FAMILIES

    p = argparse.ArgumentParser(prog="python -m bench.make_gguf", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="GGUF file to write")
    p.add_argument("--arch", default="llama", help=f"one of {', '.join(FAMILIES)} (default llama)")
    p.add_argument("--qtype", default="Q4_0", help=f"one of {', '.join(QTYPES)} (default Q4_0)")
    p.add_argument("--seed", type=int, default=0)
    for name in SHAPE_FLAGS:  # unset: the --arch preset's value
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    p.add_argument("--rope-theta", type=float, default=None)
    p.add_argument("--untied", action="store_true", help="write a separate output.weight")
    p.add_argument("--experts", type=int, default=0, help="experts per layer (Mixtral-style MoE; 0: dense)")
    p.add_argument("--experts-used", type=int, default=0, help="experts per token (with --experts)")
    return p.parse_args(argv)


def shape_from_args(args: argparse.Namespace, preset: LlamaShape) -> LlamaShape:
    """`preset` with every shape flag the user gave put in its place."""
    given = {
        name: getattr(args, name) for name in (*SHAPE_FLAGS, "rope_theta") if getattr(args, name) is not None
    }
    if args.untied:
        given["tie_embeddings"] = False
    return replace(preset, **given, experts=args.experts, experts_used=args.experts_used)


def main(argv: Sequence[str] | None = None) -> int:
    from bench.gguf_families import family, write_family_gguf

    args = parse_args(argv)
    try:
        shape = shape_from_args(args, family(args.arch).preset)
        path = write_family_gguf(args.out, args.arch, shape, args.qtype.upper(), args.seed)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
