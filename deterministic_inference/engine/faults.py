"""Fault injection for tests: make the engine fail in controlled ways. Never reachable by a request.

A `FaultInjection` is given to the `Engine` constructor by the code that builds the engine (tests), or by
`detinf serve` from the environment variable `DETINF_FAULT_INJECTION`, read ONCE at start-up (so the
process tests can start a real server with faults). Nothing in a request can enable, change or trigger
a fault that the operator did not configure at start-up. The value is comma-separated `name=value`:

    fail_step=N               the engine step N (0-based count of non-empty steps) raises: an engine bug
    hang_step=N               the engine step N blocks forever: a hung engine
    step_sleep=S              every step sleeps S seconds first (makes requests long-running)
    fail_detokenize_token=T   detokenizing the output of any sequence whose PROMPT contains token id T
                              raises (that request alone must fail)
    fail_sample_token=T       sampling any row whose prompt contains token id T raises (the batched call
                              and that row alone: the other rows must keep their bits)
    rotate_grammar_masks=1    NEGATIVE CONTROL of the grammar-mask invariance tests: each constrained
                              row of a step is sampled with the NEXT constrained row's mask (a mask
                              built from another row's state), which those tests must detect
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, fields

import torch

from deterministic_inference.engine import sampler
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.engine.step_sampling import SampleFn
from deterministic_inference.errors import ConfigError
from deterministic_inference.model.tokenizer import IncrementalDecoder, Tokenizer

ENV_VAR = "DETINF_FAULT_INJECTION"


class InjectedFault(RuntimeError):
    """Raised by an injected fault (stands for an arbitrary bug)."""


@dataclass(frozen=True)
class FaultInjection:
    """Which faults to inject (all off by default); see the module docstring."""

    fail_step: int | None = None
    hang_step: int | None = None
    step_sleep: float = 0.0
    fail_detokenize_token: int | None = None
    fail_sample_token: int | None = None
    rotate_grammar_masks: bool = False

    @classmethod
    def parse(cls, text: str) -> FaultInjection:
        """From `name=value,name=value`; ConfigError naming the bad item."""
        values: dict[str, float | int] = {}
        kinds = {f.name: f for f in fields(cls)}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, _, raw = item.partition("=")
            if name not in kinds:
                raise ConfigError(f"{ENV_VAR}: unknown fault {name!r}; known: {', '.join(kinds)}")
            try:
                values[name] = float(raw) if name == "step_sleep" else int(raw)
            except ValueError:
                raise ConfigError(f"{ENV_VAR}: {name}={raw!r} is not a number") from None
        return cls(**values)  # type: ignore[arg-type]

    def before_step(self, step_index: int) -> None:
        """Called by the engine before each non-empty step."""
        if self.step_sleep > 0:
            time.sleep(self.step_sleep)
        if step_index == self.hang_step:
            threading.Event().wait()  # never set: the step never returns
        if step_index == self.fail_step:
            raise InjectedFault(f"injected engine fault at step {step_index}")

    def decoder(self, tokenizer: Tokenizer, prompt_token_ids: list[int]) -> IncrementalDecoder:
        """The output decoder of a sequence: one that raises when its prompt carries the marker token."""
        if self.fail_detokenize_token is not None and self.fail_detokenize_token in prompt_token_ids:
            return _FailingDecoder(tokenizer)
        return tokenizer.incremental_decoder()

    def sample_fn(self) -> SampleFn | None:
        """`sampler.sample`, raising whenever a row's prompt carries the marker token, and/or with the
        constrained rows' masks rotated by one row; None when both are off."""
        marker = self.fail_sample_token
        rotate = self.rotate_grammar_masks
        if marker is None and not rotate:
            return None

        def sample(
            logits: torch.Tensor,
            params: list[SamplingParams],
            seeds: list[int],
            positions: list[int],
            past_tokens: list[list[int]],
            output_tokens: list[list[int]],
            masks: list[torch.Tensor | None],
        ) -> sampler.SampleResult:
            pairs = zip(past_tokens, output_tokens, strict=True)
            prompts = (past[: len(past) - len(out)] for past, out in pairs)
            if marker is not None and any(marker in prompt for prompt in prompts):
                raise InjectedFault("injected sampling fault")
            if rotate:
                masks = _rotated(masks)
            return sampler.sample(logits, params, seeds, positions, past_tokens, output_tokens, masks)

        return sample


def _rotated(masks: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Each constrained row gets the next constrained row's mask (the last gets the first's)."""
    constrained = [r for r, mask in enumerate(masks) if mask is not None]
    rotated = list(masks)
    for i, r in enumerate(constrained):
        rotated[r] = masks[constrained[(i + 1) % len(constrained)]]
    return rotated


class _FailingDecoder(IncrementalDecoder):
    """A decoder whose every push raises (an injected detokenization bug)."""

    def push(self, token_id: int) -> str:
        raise InjectedFault("injected detokenization fault")
