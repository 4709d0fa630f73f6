"""Shared by the RL tests: sampling through the engine and comparing logprobs as raw float32 bits."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Sampled:
    """One sampled completion: the token ids and the engine's logprob of each completion token."""

    prompt: list[int]
    completion: list[int]
    logprobs: torch.Tensor  # [len(completion)] fp32, from the engine's Python floats (exact)
    cached_tokens: int  # prompt tokens the engine took from the prefix cache


def bits(values: torch.Tensor) -> list[int]:
    """Raw float32 bits (so no tolerance, and -0.0 != +0.0)."""
    return values.detach().to(torch.float32).contiguous().view(torch.int32).tolist()


def mixed_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts of 3..40 tokens; every third shares one 33-token prefix (prefix-cache hits, 2 blocks)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(33)]
    prompts = []
    for index in range(count):
        if index % 3 == 0:
            prompts.append(prefix + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 6))])
        else:
            prompts.append([rng.randrange(3, vocab) for _ in range(rng.randint(3, 40))])
    return prompts


def sample(engine: Engine, prompts: list[list[int]], first_seed: int, max_tokens: int = 10) -> list[Sampled]:
    """Seeded T=1.0 completions of `prompts` run together as one batch."""
    params = [
        SamplingParams(temperature=1.0, seed=first_seed + i, max_tokens=max_tokens, ignore_eos=True)
        for i in range(len(prompts))
    ]
    outputs = engine.generate(prompts, params)
    return [
        Sampled(
            list(prompt),
            list(out.outputs[0].token_ids),
            torch.tensor(out.outputs[0].logprobs, dtype=torch.float32),
            out.num_cached_tokens,
        )
        for prompt, out in zip(prompts, outputs, strict=True)
    ]
