"""One process of the cross-ISA test (test_portable_numerics.py): run a fixed mixed batch on a model and
print every output as exact bits (JSON on stdout).

    python -m tests.engine.portable_probe --threads 2 --case PATH:float32 [--case default:auto ...]

The batch mixes greedy and seeded requests (top-p, top-k + min-p + penalties: the sampler's batched and
per-row paths), asks for top logprobs and prompt logprobs, and runs with a small token budget so the
prompts are prefilled in chunks. The caller sets the environment under test (ATEN_CPU_CAPABILITY,
DETINF_KERNEL_MARCH, ONEDNN_MAX_CPU_ISA, DETINF_TEST_TORCH_LOG_SOFTMAX).
"""

from __future__ import annotations

import argparse
import json
import random
import struct
from typing import Any

import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.sampling_params import SamplingParams

PARAMS = (
    SamplingParams(max_tokens=10, temperature=0.0, logprobs=3, prompt_logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=3, logprobs=2, ignore_eos=True),
    SamplingParams(
        max_tokens=10,
        temperature=1.1,
        top_k=20,
        min_p=0.05,
        seed=5,
        repetition_penalty=1.3,
        frequency_penalty=0.2,
        logprobs=1,
        ignore_eos=True,
    ),  # fmt: skip
    SamplingParams(max_tokens=10, temperature=0.0, presence_penalty=0.5, prompt_logprobs=0, ignore_eos=True),
)
TEXT_PROMPTS = (
    "Name three rivers of Europe.",
    "Write a haiku about a grey cat sleeping in the sun near an open window in spring.",
    "2 + 2 =",
    "Translate to French: the library opens at nine in the morning and closes late.",
)


def bits(value: float | None) -> int | None:
    """Raw float32 bits of a logprob (None stays None)."""
    return None if value is None else int(struct.unpack("<I", struct.pack("<f", value))[0])


def run(model: str, dtype: str, threads: int) -> dict[str, Any]:
    """The batch's outputs as bits, with the ISA torch dispatched to (to show the variation took)."""
    config = EngineConfig(
        model=None if model == "default" else model, dtype=dtype, threads=threads, max_num_batched_tokens=16
    )
    engine = Engine(config)
    if model == "default":
        prompts: list[Any] = list(TEXT_PROMPTS)
    else:
        rng = random.Random(7)
        vocab = engine.spec.vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(length)] for length in (5, 23, 40, 9)]
    outputs = engine.generate(prompts, list(PARAMS))
    results = []
    for output in outputs:
        choice = output.outputs[0]
        results.append(
            {
                "tokens": choice.token_ids,
                "logprobs": [bits(v) for v in choice.logprobs],
                "top": [[(t, bits(v)) for t, v in step] for step in choice.top_logprobs],
                "prompt_logprobs": [bits(v) for v in output.prompt_logprobs or []],
                "prompt_top": [
                    [(t, bits(v)) for t, v in step or []] for step in output.prompt_top_logprobs or []
                ],
            }
        )
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "results": results}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--case", action="append", required=True, help="MODEL:DTYPE (MODEL a path or default)"
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    cases = [case.rsplit(":", 1) for case in args.case]
    print(json.dumps([run(model, dtype, args.threads) for model, dtype in cases]))


if __name__ == "__main__":
    main()
