"""Where an engine step's time goes: GEMMs, attention, the other row-wise ops, the logits head, sampling,
and the Python and scheduling around them, for prefill steps and decode steps apart.

Used by `bench.bench_engine --profile` (its `inv` runs); not a test. Two profiles of the same prompts:
- the fused path, the one the engine runs (ops/fused.py: every layer in one C call): csrc/decoder.c times
  each of its kernel calls when `FusedDecoder.phase_seconds` is set (ops/fused.py PHASES; the clock read
  around each call, nothing else changes), and hooks time the logits head and the sampler. Each phase
  includes its OpenMP barrier waits. Shown as the table plus ms per step of every phase.
- the per-op path: timing hooks wrap, in this process only, the layers' linears (`Linear.__call__`), the
  backend's attention and row-wise ops, the model's logits head, the sampler (`step_sampling.sample_step`)
  and the engine step; the same kernels and bits, plus ~1 us of Python per op call, which lands in
  "Python + scheduling". For models the fused path does not serve, this is the only one.
Each label's time is exclusive of the hooks nested in it, except that everything inside the logits head
and the sampler counts for them (the head's linear is the logits head, not "GEMMs"). The untimed fused
run before it gives the real step time to compare with.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from deterministic_inference.engine import step_sampling
from deterministic_inference.engine.engine import Engine
from deterministic_inference.ops.fused import PHASES
from deterministic_inference.ops.linear import Linear

ROW_OPS = ("add_rms_norm", "rms_norm", "rotary_write_kv", "silu_mul")
OPAQUE = ("logits head", "sampling")  # labels whose nested hooks count for them (the head's linear)
LABELS = ("GEMMs", "attention", "norms, rotary, silu", "logits head", "sampling", "Python + scheduling")
# the fused path's phases (ops/fused.py PHASES) under the labels above
PHASE_LABELS = {
    "norms": "norms, rotary, silu", "qkv": "GEMMs", "rotary + KV write": "norms, rotary, silu",
    "attention": "attention", "attention -> bf16": "attention", "o_proj": "GEMMs", "gate_up": "GEMMs",
    "silu_mul": "norms, rotary, silu", "down": "GEMMs",
}  # fmt: skip


@dataclass
class StepProfile:
    """Exclusive seconds per label, summed over the steps of one kind (prefill or decode)."""

    steps: int = 0
    rows: int = 0  # tokens computed (prefill) or sequences decoded, summed over the steps
    seconds: float = 0.0
    by_label: dict[str, float] = field(default_factory=lambda: defaultdict(float))


class Profiler:
    """Timing hooks with exclusive accounting: a stack of open labels, each charged its own time only
    (an OPAQUE label is charged its nested hooks too)."""

    def __init__(self) -> None:
        self._stack: list[list[Any]] = []  # [label, start, seconds of nested hooks]
        self.current: dict[str, float] = defaultdict(float)

    def timed(self, label: str, call: Callable[..., Any]) -> Callable[..., Any]:
        """`call` wrapped: its time minus its nested hooks' goes to `label`."""

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._stack and self._stack[-1][0] in OPAQUE:
                return call(*args, **kwargs)  # counted whole by the outer label
            self._stack.append([label, time.perf_counter(), 0.0])
            try:
                return call(*args, **kwargs)
            finally:
                _, start, nested = self._stack.pop()
                spent = time.perf_counter() - start
                self.current[label] += spent - nested
                if self._stack:
                    self._stack[-1][2] += spent

        return wrapper


def install(engine: Engine, profiler: Profiler, fused: bool = False) -> Callable[[], None]:
    """Wrap the engine's hooks -> a function that undoes every wrap. fused: keep the fused path and time
    its phases in C (only the logits head and the sampler get hooks); else force the per-op path."""
    model, undo = engine.model, list[Callable[[], None]]()
    targets: list[tuple[Any, str, str]] = [(model, "logits", "logits head")]
    if fused and model.fused is not None:
        decoder = model.fused
        decoder.phase_seconds = torch.zeros(len(PHASES), dtype=torch.float64)
        undo.append(lambda: setattr(decoder, "phase_seconds", None))
    else:
        saved_fused, model.fused = model.fused, None
        undo.append(lambda: setattr(model, "fused", saved_fused))
        linear_call = Linear.__call__
        Linear.__call__ = profiler.timed("GEMMs", linear_call)  # type: ignore[method-assign]
        undo.append(lambda: setattr(Linear, "__call__", linear_call))
        targets.append((model.ops, "attention", "attention"))
        targets += [(model.ops, name, "norms, rotary, silu") for name in ROW_OPS]
    sample_step = step_sampling.sample_step
    step_sampling.sample_step = profiler.timed("sampling", sample_step)
    undo.append(lambda: setattr(step_sampling, "sample_step", sample_step))
    for owner, name, label in targets:
        setattr(owner, name, profiler.timed(label, getattr(owner, name)))
        undo.append(functools.partial(delattr, owner, name))  # the class's method again

    def undo_all() -> None:
        for step in reversed(undo):
            step()

    return undo_all


def profile_generate(
    engine: Engine, prompts: list[list[int]], params: Any, fused: bool = False
) -> dict[str, StepProfile]:
    """Run `prompts` to the end one step at a time -> {"prefill": ..., "decode": ...} (a step with any
    chunk of more than one token counts as prefill). fused: the fused path with its phases timed in C
    (the phases also land in `by_label` under their own names, prefixed ". ")."""
    profiler = Profiler()
    decoder = engine.model.fused
    undo = install(engine, profiler, fused)
    phases = decoder.phase_seconds if fused and decoder is not None else None
    engine.record_trace, engine.trace = True, []
    kinds = {"prefill": StepProfile(), "decode": StepProfile()}
    try:
        for prompt in prompts:
            engine.add_request(prompt, params)
        while engine.has_unfinished:
            profiler.current = defaultdict(float)
            start = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - start
            chunks = engine.trace[-1].chunks
            kind = kinds["prefill" if any(len(chunk.token_ids) > 1 for chunk in chunks) else "decode"]
            kind.steps += 1
            kind.rows += sum(len(chunk.token_ids) for chunk in chunks)
            kind.seconds += seconds
            if phases is not None:
                for name, spent in zip(PHASES, phases.tolist(), strict=True):
                    profiler.current[PHASE_LABELS[name]] += spent
                    kind.by_label[f". {name}"] += spent
                phases.zero_()
            for label, spent in profiler.current.items():
                kind.by_label[label] += spent
            kind.by_label["Python + scheduling"] += seconds - sum(profiler.current.values())
    finally:
        undo()
        engine.record_trace = False
    return kinds


def print_profile(name: str, kinds: dict[str, StepProfile], path: str = "per-op path") -> None:
    """One markdown table: per kind, ms per step and the share of each label; then the fused path's
    phases in ms per step, when timed."""
    print(f"\n{name}: where a step's time goes (exclusive; {path})")
    print("| step | steps | rows/step | ms/step | " + " | ".join(LABELS) + " |")
    print("|---|---|---|---|" + "---|" * len(LABELS))
    for kind, prof in kinds.items():
        if not prof.steps:
            continue
        shares = [f"{100 * prof.by_label.get(label, 0.0) / prof.seconds:.1f}%" for label in LABELS]
        per_step = 1000 * prof.seconds / prof.steps
        rows = prof.rows / prof.steps
        print(f"| {kind} | {prof.steps} | {rows:.0f} | {per_step:.1f} | {' | '.join(shares)} |")
    phase_rows = [(kind, prof) for kind, prof in kinds.items()
                  if prof.steps and f". {PHASES[0]}" in prof.by_label]
    if phase_rows:
        print("\n| step | " + " | ".join(PHASES) + " |  (ms per step, summed over the layers)")
        print("|---|" + "---|" * len(PHASES))
        for kind, prof in phase_rows:
            cells = [f"{1000 * prof.by_label[f'. {phase}'] / prof.steps:.2f}" for phase in PHASES]
            print(f"| {kind} | {' | '.join(cells)} |")
