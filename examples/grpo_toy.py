"""A toy GRPO loop on the default model with exact on-policy importance ratios.

Each step: the engine samples a group of seeded completions (T = 1.0) per prompt; the policy recomputes
the logprob of every sampled token with a forward pass over the engine's own kernels; the loop checks
that the importance ratio exp(policy logprob - sampler logprob) is exactly 1.0 for every token (the
logprobs are bitwise equal); it then takes a policy-gradient step with group-normalised advantages and
pushes the new weights into the engine, whose fingerprint changes. The reward is a toy: the share of
vowels among the letters of the completion.

    .venv/bin/python examples/grpo_toy.py                 # 4 steps, 2 prompts x 4 samples, 24 tokens
    .venv/bin/python examples/grpo_toy.py --steps 8 --group 8 --lr 3e-5

Runs on CPU in a few minutes (untested on GPU). Without clipping or a KL term: with ratios of exactly 1
and one update per batch, PPO-style clipping would never trigger.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.rl import Policy

QUESTIONS = ("Name a fruit and describe it.", "Write one sentence about the sea.")


@dataclass(frozen=True)
class Completion:
    """One sampled completion of a group."""

    group: int  # index of its prompt
    prompt: list[int]
    tokens: list[int]
    sampler_logprobs: torch.Tensor  # [len(tokens)] fp32: what the engine reported
    reward: float


def vowel_share(text: str) -> float:
    """The toy reward: vowels / letters (0 when there are no letters)."""
    letters = [c for c in text.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0


def sample_groups(
    engine: Engine, prompts: list[list[int]], group: int, step: int, max_tokens: int
) -> list[Completion]:
    """`group` seeded completions per prompt, all in one engine batch."""
    jobs = [(g, prompt) for g, prompt in enumerate(prompts) for _ in range(group)]
    params = [
        SamplingParams(temperature=1.0, seed=step * 1000 + i, max_tokens=max_tokens) for i in range(len(jobs))
    ]
    outputs = engine.generate([prompt for _, prompt in jobs], params)
    completions = []
    for (g, prompt), output in zip(jobs, outputs, strict=True):
        choice = output.outputs[0]
        if not choice.token_ids:  # an immediate end of sequence: nothing to learn from
            continue
        logprobs = torch.tensor(choice.logprobs, dtype=torch.float32)
        completions.append(Completion(g, prompt, list(choice.token_ids), logprobs, vowel_share(choice.text)))
    return completions


def advantages(completions: list[Completion]) -> list[float]:
    """GRPO: each reward minus its group's mean, over the group's standard deviation."""
    by_group: dict[int, list[float]] = {}
    for c in completions:
        by_group.setdefault(c.group, []).append(c.reward)
    result = []
    for c in completions:
        rewards = by_group[c.group]
        spread = statistics.pstdev(rewards) if len(rewards) > 1 else 0.0
        result.append((c.reward - statistics.fmean(rewards)) / (spread + 1e-6))
    return result


def check_on_policy(completions: list[Completion], policy_logprobs: list[torch.Tensor]) -> int:
    """Assert the importance ratio is exactly 1.0 for every token; returns the number of tokens."""
    tokens = 0
    for c, new in zip(completions, policy_logprobs, strict=True):
        ratio = torch.exp(new.detach() - c.sampler_logprobs)
        same_bits = torch.equal(new.detach().view(torch.int32), c.sampler_logprobs.view(torch.int32))
        if not (same_bits and bool((ratio == 1.0).all())):
            raise AssertionError("off-policy: a trainer logprob differs from the sampler's")
        tokens += len(c.tokens)
    return tokens


def train_step(
    policy: Policy, optimizer: torch.optim.Optimizer, completions: list[Completion]
) -> tuple[int, float]:
    """Recompute the logprobs, check the ratios, take one policy-gradient step -> (tokens, loss)."""
    new = policy.completion_logprobs([c.prompt for c in completions], [c.tokens for c in completions])
    tokens = check_on_policy(completions, new)
    old = [c.sampler_logprobs for c in completions]
    terms = [
        (torch.exp(lp - lp_old) * adv).sum() / len(lp)  # ratio == 1 in value; its gradient is d logp
        for lp, lp_old, adv in zip(new, old, advantages(completions), strict=True)
    ]
    loss = -torch.stack(terms).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return tokens, float(loss.detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument(
        "--model", default=None, help="GGUF file or HF directory (default: the default model)"
    )
    args = parser.parse_args()
    config = EngineConfig(model=args.model, quantization="none", threads=args.threads)  # float weights
    engine = Engine(config)
    policy = Policy.for_engine(engine)  # fp32 master weights; forward in the engine's dtype
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    prompts = [
        engine.encode_prompt(engine.tokenizer.apply_chat_template([{"role": "user", "content": q}]))
        for q in QUESTIONS
    ]
    print(f"engine {engine.system_fingerprint}, dtype {engine.dtype_name}")
    for step in range(args.steps):
        start = time.perf_counter()
        completions = sample_groups(engine, prompts, args.group, step, args.max_tokens)
        sampled = time.perf_counter()
        tokens, loss = train_step(policy, optimizer, completions)
        trained = time.perf_counter()
        fingerprint = engine.update_weights(policy.engine_weights())
        pushed = time.perf_counter()
        reward = statistics.fmean(c.reward for c in completions)
        print(
            f"step {step}: mean reward {reward:.3f}, {tokens} tokens all with ratio exactly 1.0, "
            f"loss {loss:+.4f}; sample {sampled - start:.1f} s, train {trained - sampled:.1f} s, "
            f"push {pushed - trained:.1f} s -> {fingerprint}"
        )


if __name__ == "__main__":
    main()
