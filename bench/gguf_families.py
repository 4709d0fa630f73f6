"""The model families `bench.make_gguf --arch` writes, in llama.cpp's layouts, each with a shape preset.

    --arch   written as   preset shape                                       layout
    llama    llama        Llama-3.2-1B                                       q, k, v, gate, up, down
    mistral  llama        Mistral-7B (window 4096)                           + a sliding_window key
    gemma3   gemma3       Gemma-3-1B (window 512, 5 local : 1 global)        + q/k and post norms; tied
    gemma2   gemma2       Gemma-2-2B (window 4096, soft-caps 50 / 30)        + post norms; tied
    phi3     phi3         Phi-3-mini-4k (window 2047)                        fused attn_qkv, ffn_up

The metadata keys are the ones llama.cpp's converter writes: `{arch}.attention.sliding_window`,
`gemma2.attn_logit_softcapping` / `final_logit_softcapping`, `{arch}.attention.key_length` (Gemma's head
width 256 is not hidden / heads), `phi3.rope.scaling.original_context_length`. What llama.cpp fixes by
architecture is not written: Gemma 3's layer pattern (every 6th layer global) and local rope base 10000,
Gemma 2's alternating layers. Gemma's norm weights are stored as 1 + w, as the converter writes them:
Gaussian around 1 like every other family's norms here. Phi-3's `ffn_up` holds gate then up [2 * ffn,
hidden]; `attn_qkv` holds q, k, v rows [(heads + 2 * kv_heads) * head_dim, hidden].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.make_gguf import (
    LayerTensors,
    LlamaShape,
    default_tokenizer_source,
    format_plan,
    llama_layer_tensors,
    llama_metadata,
    model_tensors,
    read_tokenizer_fields,
    write_gguf,
)


@dataclass(frozen=True)
class Family:
    """One `--arch` choice: the GGUF architecture it is written as, its preset shape, its per-layer
    tensors and the metadata keys it adds to the Llama ones."""

    gguf_arch: str
    preset: LlamaShape
    layer_tensors: Callable[[LlamaShape], LayerTensors]
    extra_metadata: dict[str, Any] = field(default_factory=dict)
    moe: bool = False  # --experts allowed (the Mixtral layout exists for llama only)


def _gemma_layer(qk_norm: bool) -> Callable[[LlamaShape], LayerTensors]:
    """Gemma 2 / 3 blocks: Llama's plus post-attention and post-feed-forward norms (`ffn_norm` is the
    pre-feed-forward norm), Gemma 3 also RMS-norms q and k per head ([head_dim] weights)."""

    def tensors(shape: LlamaShape) -> LayerTensors:
        hidden, dim, ffn = shape.hidden, shape.dim, shape.ffn
        q_k_norms = (("attn_q_norm.weight", (dim,)), ("attn_k_norm.weight", (dim,))) if qk_norm else ()
        return (
            ("attn_norm.weight", (hidden,)), ("attn_q.weight", (shape.heads * dim, hidden)),
            ("attn_k.weight", (shape.kv_heads * dim, hidden)),
            ("attn_v.weight", (shape.kv_heads * dim, hidden)), *q_k_norms,
            ("attn_output.weight", (hidden, shape.heads * dim)), ("post_attention_norm.weight", (hidden,)),
            ("ffn_norm.weight", (hidden,)), ("ffn_gate.weight", (ffn, hidden)),
            ("ffn_up.weight", (ffn, hidden)), ("ffn_down.weight", (hidden, ffn)),
            ("post_ffw_norm.weight", (hidden,)),
        )  # fmt: skip

    return tensors


def _phi3_layer(shape: LlamaShape) -> LayerTensors:
    """Phi-3 blocks: q, k, v in one `attn_qkv`, gate and up in one `ffn_up` (split by rows on load)."""
    hidden, dim, ffn = shape.hidden, shape.dim, shape.ffn
    qkv_rows = (shape.heads + 2 * shape.kv_heads) * dim
    return (
        ("attn_norm.weight", (hidden,)), ("attn_qkv.weight", (qkv_rows, hidden)),
        ("attn_output.weight", (hidden, shape.heads * dim)), ("ffn_norm.weight", (hidden,)),
        ("ffn_up.weight", (2 * ffn, hidden)), ("ffn_down.weight", (hidden, ffn)),
    )  # fmt: skip


GEMMA2_SOFTCAPS = {"gemma2.attn_logit_softcapping": 50.0, "gemma2.final_logit_softcapping": 30.0}

FAMILIES: dict[str, Family] = {
    "llama": Family("llama", LlamaShape(), llama_layer_tensors, moe=True),
    "mistral": Family(
        "llama",
        LlamaShape(
            hidden=4096,
            layers=32,
            heads=32,
            kv_heads=8,
            ffn=14336,
            context=32768,
            rope_theta=10000.0,
            tie_embeddings=False,
            sliding_window=4096,
        ),
        llama_layer_tensors,
        moe=True,
    ),
    "gemma3": Family(
        "gemma3",
        LlamaShape(
            hidden=1152,
            layers=26,
            heads=4,
            kv_heads=1,
            ffn=6912,
            head_dim=256,
            context=32768,
            rope_theta=1_000_000.0,
            rms_eps=1e-6,
            sliding_window=512,
        ),
        _gemma_layer(qk_norm=True),
    ),
    "gemma2": Family(
        "gemma2",
        LlamaShape(
            hidden=2304,
            layers=26,
            heads=8,
            kv_heads=4,
            ffn=9216,
            head_dim=256,
            context=8192,
            rope_theta=10000.0,
            rms_eps=1e-6,
            sliding_window=4096,
        ),
        _gemma_layer(qk_norm=False),
        GEMMA2_SOFTCAPS,
    ),
    "phi3": Family(
        "phi3",
        LlamaShape(
            hidden=3072,
            layers=32,
            heads=32,
            kv_heads=32,
            ffn=8192,
            context=4096,
            rope_theta=10000.0,
            tie_embeddings=False,
            sliding_window=2047,
        ),
        _phi3_layer,
    ),
}


def family(name: str) -> Family:
    """The family `--arch name` writes; ValueError naming the choices otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"--arch must be one of {', '.join(FAMILIES)}, got {name!r}")
    return FAMILIES[name]


def check_family_shape(name: str, shape: LlamaShape) -> None:
    """Raise ValueError naming the flag when `shape` does not fit family `name`'s layout."""
    fam = family(name)
    if shape.experts and not fam.moe:
        raise ValueError(f"--experts is for --arch llama or mistral (Mixtral layout), not {name}")
    if fam.gguf_arch.startswith("gemma") and not shape.tie_embeddings:
        raise ValueError(f"--arch {name} ties the output head to the embedding: drop --untied")
    if name == "phi3" and shape.tie_embeddings:
        raise ValueError("--arch phi3 has a separate output head (llama.cpp requires output.weight)")


def family_metadata(name: str, shape: LlamaShape) -> dict[str, Any]:
    """The keys family `name` adds to the Llama ones (`make_gguf.llama_metadata`)."""
    fam = family(name)
    extra = dict(fam.extra_metadata)
    if name == "phi3":  # the converter writes it; equal to the context: no long-rope scaling
        extra["phi3.rope.scaling.original_context_length"] = shape.context
    return extra


def write_family_gguf(
    path: Path | str,
    name: str = "llama",
    shape: LlamaShape | None = None,
    qtype: str = "Q4_0",
    seed: int = 0,
    tokenizer_source: Path | None = None,
) -> Path:
    """Write a random-weight GGUF of family `name` (its preset shape when `shape` is None) in `qtype`
    to `path`, deterministic for the arguments (`make_gguf.write_gguf`). Returns the path."""
    fam = family(name)
    shape = shape or fam.preset
    shape.check()
    check_family_shape(name, shape)
    plan = format_plan(qtype, shape.layers, shape.tie_embeddings)
    tokenizer = read_tokenizer_fields(tokenizer_source or default_tokenizer_source())
    metadata = llama_metadata(shape, fam.gguf_arch, qtype)
    metadata["general.name"] = f"random-{name}-{shape.layers}L-{shape.hidden}-{qtype}"
    metadata.update(family_metadata(name, shape))
    tensors = model_tensors(shape, tokenizer.vocab, plan, fam.layer_tensors(shape))
    return write_gguf(Path(path), fam.gguf_arch, metadata, tensors, seed, tokenizer)
