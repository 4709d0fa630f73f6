"""Start-up self-check: probe every batch-invariant op at a model's real shapes on this machine.

Invariance is a property of the kernels that run on this CPU, not of our code alone, so before serving
in invariant mode the engine runs the probes of `ops/probes.py` through the model's own ops backend
(random weights of the real shapes; a few seconds for SmolLM2-135M) and refuses to start, naming the op
and shape, if any probe differs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deterministic_inference.errors import SelfCheckError
from deterministic_inference.model.spec import ModelSpec
from deterministic_inference.ops.backend import Numerics, select_backend
from deterministic_inference.ops.linear import Linear
from deterministic_inference.ops.probes import (
    AttentionWorld,
    BlockProbe,
    ProbeResult,
    attention_probe,
    block_probes,
    elementwise_probes,
    exp_probe,
    linear_probes,
    torch_threads,
)

__all__ = ["AttentionWorld", "BlockProbe", "ProbeResult", "SelfCheckReport", "run_selfcheck", "torch_threads"]


@dataclass(frozen=True)
class SelfCheckReport:
    """Every probe of one self-check run, with the settings it ran under."""

    results: tuple[ProbeResult, ...]
    dtype: str
    batch_invariant: bool
    tile_rows: int
    threads: int
    seconds: float

    @property
    def ok(self) -> bool:
        """True when every probe passed."""
        return all(result.ok for result in self.results)

    @property
    def failures(self) -> tuple[ProbeResult, ...]:
        """The probes that differed."""
        return tuple(result for result in self.results if not result.ok)

    def table(self) -> str:
        """A fixed-width text table, one line per probe, then a summary line."""
        op_width = max(len("op"), *(len(r.op) for r in self.results))
        shape_width = max(len("shape"), *(len(r.shape) for r in self.results))
        lines = [f"{'op':<{op_width}}  {'shape':<{shape_width}}  ok    detail"]
        for r in self.results:
            lines.append(
                f"{r.op:<{op_width}}  {r.shape:<{shape_width}}  {'ok' if r.ok else 'FAIL':<4}  {r.detail}"
            )
        verdict = "all probes bitwise equal" if self.ok else f"{len(self.failures)} probe(s) FAILED"
        lines.append(
            f"{verdict}: dtype {self.dtype}, batch_invariant {self.batch_invariant}, tile_rows "
            f"{self.tile_rows}, threads {self.threads}, {self.seconds:.1f} s"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict."""
        return {
            "ok": self.ok,
            "dtype": self.dtype,
            "batch_invariant": self.batch_invariant,
            "tile_rows": self.tile_rows,
            "threads": self.threads,
            "seconds": round(self.seconds, 3),
            "probes": [vars(r).copy() for r in self.results],
        }

    def raise_if_failed(self) -> None:
        """Raise SelfCheckError naming every failed op and shape."""
        failed = "; ".join(f"{r.op} {r.shape}: {r.detail}" for r in self.failures)
        if failed:
            raise SelfCheckError(
                f"batch-invariance self-check failed on this machine ({failed}). Outputs would depend on "
                "batch composition here: try another dtype or linear_tile_rows, or start with batch "
                "invariance off (outputs then not reproducible). `detinf selfcheck` prints every probe."
            )


def run_selfcheck(
    spec: ModelSpec,
    numerics: Numerics,
    threads: int | None,
    linears: Sequence[tuple[str, Linear]] | None = None,
    blocks: Sequence[BlockProbe] = (),
) -> SelfCheckReport:
    """Probe every op the model uses at its real shapes through the backend `numerics` selects; threads
    None = torch's current.

    References are computed with one thread, probes with `threads`, so a pass also shows the thread
    count does not change bits. Random data comes from a fixed seed (the check itself is reproducible).
    `linears` are the model's own linears (`DecoderModel.probe_linears`: one per role and weight-format
    mix, so every format the model uses is probed); None probes random dense weights of `spec`'s shapes.
    `blocks` are whole blocks of the model probed as row functions (`DecoderModel.probe_blocks`: its
    first mixture-of-experts MLP, where expert loads change with the batch).
    """
    probe_threads = threads if threads is not None else torch.get_num_threads()
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    results: list[ProbeResult] = []
    ops = select_backend(numerics)
    with torch_threads(probe_threads):
        results.extend(linear_probes(spec, ops, probe_threads, generator, linears))
        results.extend(elementwise_probes(spec, ops, probe_threads, generator))
        results.extend(block_probes(blocks, ops, probe_threads, generator))
        results.append(exp_probe(generator))
        results.append(attention_probe(spec, ops, probe_threads, generator))
    return SelfCheckReport(
        results=tuple(results),
        dtype=str(numerics.dtype).removeprefix("torch."),
        batch_invariant=numerics.batch_invariant,
        tile_rows=numerics.tile_rows,
        threads=probe_threads,
        seconds=time.perf_counter() - start,
    )
