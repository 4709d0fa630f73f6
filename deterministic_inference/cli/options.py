"""CLI options defined once and shared by the commands that build an engine (generate, serve, ...)."""

from __future__ import annotations

import argparse
from pathlib import Path

from deterministic_inference.config import (
    DTYPES,
    KV_CACHE_DTYPES,
    NUMERICS_MODES,
    QUANTIZATIONS,
    EngineConfig,
    parse_bytes,
)
from deterministic_inference.engine.speculative import SpeculativeConfig
from deterministic_inference.errors import ConfigError
from deterministic_inference.model.gguf_choice import choose_gguf


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """Options that map to `EngineConfig` fields."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model", default=None,
        help="GGUF file, HF directory, or a directory of GGUF files with --model-file (default: embedded "
        "SmolLM2-135M)",
    )
    add_model_file_option(group)
    add_numerics_options(group)
    group.add_argument("--no-prefix-cache", action="store_true", help="disable automatic prefix caching")
    group.add_argument(
        "--max-num-seqs", type=int, default=EngineConfig.max_num_seqs,
        help=f"sequences run together in one engine step (default {EngineConfig.max_num_seqs})",
    )
    group.add_argument(
        "--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens,
        help="tokens processed in one engine step; longer prompts are prefilled in chunks "
        f"(default {EngineConfig.max_num_batched_tokens})",
    )
    group.add_argument(
        "--max-model-len", type=int, default=None,
        help="longest sequence (prompt + output) accepted (default: the model's context length)",
    )
    group.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks")
    group.add_argument(
        "--kv-cache-memory",
        default=None,
        help="KV pool cap: bytes or a size like 2GiB, 512MiB (default 2GiB; memory is used as blocks fill)",
    )
    group.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    group.add_argument("--default-seed", type=int, default=0, help="seed of requests that give none")
    group.add_argument("--no-selfcheck", action="store_true", help="skip the start-up invariance probes")
    group.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding as JSON (vLLM\'s fields), e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}\'; '
        "the tokens and logprobs stay those of plain decoding (default: off)",
    )


def add_numerics_options(group: argparse._ArgumentGroup) -> None:
    """The engine options that decide the arithmetic (the fingerprint's numerics): weight and activation
    dtype, quantization, KV cache format, portable or native numerics, and the invariance switch."""
    group.add_argument("--dtype", default="auto", choices=DTYPES, help="weights/activations dtype")
    group.add_argument(
        "--quantization",
        default="auto",
        choices=QUANTIZATIONS,
        help="auto: GGUF weights as stored, HF in --dtype; none: dequantise all to --dtype; q8_0: quantize "
        "float weights to Q8_0 at load",
    )
    group.add_argument(
        "--kv-cache-dtype",
        default="auto",
        metavar="{" + ",".join(KV_CACHE_DTYPES) + "}",
        help="KV cache format: auto (the model dtype), bf16, or q8_0 (32 int8 values and an fp32 scale per "
        "32, 0.56x bf16's bytes; exact and batch invariant, recorded in the fingerprint)",
    )
    group.add_argument(
        "--numerics",
        default="portable",
        metavar="{" + ",".join(NUMERICS_MODES) + "}",
        help="portable: bits fixed by our source, the same on every x86-64 CPU; native: the bf16 GEMM on "
        "this CPU's AMX-BF16 tiles, a quantized file's blocks dequantised to bf16 into them as the GEMM "
        "reads them (faster in batches, slower for one stream; still batch, chunk and thread invariant, "
        "but the bits hold on this CPU class only: the fingerprint records the ISA). Refused where the "
        "CPU has no AMX-BF16",
    )
    group.add_argument("--no-batch-invariant", action="store_true", help="plain torch ops (not reproducible)")


def add_model_file_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--model-file NAME`: the GGUF file to load from the directory `--model` names."""
    parser.add_argument(
        "--model-file", default=None, metavar="NAME",
        help="the GGUF file to load from the --model directory (e.g. a *-GGUF Hugging Face snapshot holding "
        "one file per quantization); not needed when the directory holds one GGUF and no config.json",
    )


def model_path_from_args(model: str | None, model_file: str | None) -> str | None:
    """The path `EngineConfig.model` gets: `--model`, or the `--model-file` GGUF inside that directory
    (a directory of several GGUFs without --model-file is refused when it loads, listing them)."""
    if model_file is None:
        return model
    if model is None:
        raise ConfigError(f"--model-file {model_file}: needs --model DIR, the directory that holds it")
    directory = Path(model).expanduser()
    if not directory.is_dir():
        raise ConfigError(f"--model-file {model_file}: --model {model} is not a directory; give --model the "
                          "directory holding the GGUF file, or drop --model-file")
    chosen = choose_gguf(directory, name=model_file)
    return str(chosen) if chosen is not None else model


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """An `EngineConfig` from parsed engine options (validation errors name the field)."""
    return EngineConfig(
        model=model_path_from_args(args.model, args.model_file),
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        numerics_mode=args.numerics,
        batch_invariant=not args.no_batch_invariant,
        enable_prefix_caching=not args.no_prefix_cache,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=None if args.kv_cache_memory is None else parse_bytes(args.kv_cache_memory),
        threads=args.threads,
        seed=args.default_seed,
        selfcheck=not args.no_selfcheck,
        speculative_config=None
        if args.speculative_config is None
        else SpeculativeConfig.from_json(args.speculative_config),
    )
