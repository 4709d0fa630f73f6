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
from deterministic_inference.model_spec import ModelSpec
from deterministic_inference.ops.backend import Numerics, select_backend
from deterministic_inference.ops.linear import Linear
from deterministic_inference.ops.probes import (
    AttentionWorld,
    BlockProbe,
    ProbeResult,
    attention_probe,
    block_probes,
    elementwise_probes,
    linear_probes,
    torch_threads,
)

__all__ = [
    "AttentionWorld",
    "BlockProbe",
    "ProbeResult",
    "SelfCheck",
    "SelfCheckReport",
    "run_selfcheck",
    "torch_threads",
]


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


class SelfCheck:
    """One self-check run in two passes, so that its transient memory never sits on top of the model's.

    `probe_ops` runs the probes that need no weights (RMSNorm, silu_mul, rotary, attention: random
    data at the model's shapes) and can run before the model is built, when the process holds little;
    `probe_weights` then probes the model's own linears and blocks and returns the report. The serving
    process's peak resident memory is otherwise the model plus the probes' largest buffers.

    References are computed with one thread, probes with `threads` (None = torch's current), so a pass
    also shows the thread count does not change bits. Random data comes from one fixed-seed generator
    shared by both passes (the check itself is reproducible)."""

    def __init__(
        self,
        spec: ModelSpec,
        numerics: Numerics,
        threads: int | None,
        kv_cache_format: torch.dtype | None = None,  # the KV cache's format (torch.int8: q8_0); None: dtype
    ) -> None:
        self.spec = spec
        self.numerics = numerics
        self.kv_cache_format = kv_cache_format
        self.threads = threads if threads is not None else torch.get_num_threads()
        self.generator = torch.Generator().manual_seed(0)
        self.ops = select_backend(numerics)
        self.seconds = 0.0
        self._op_results: list[ProbeResult] | None = None

    def probe_ops(self) -> None:
        """The weightless probes (once; `probe_weights` runs them itself if they have not run)."""
        if self._op_results is not None:
            return
        start, spec, ops = time.perf_counter(), self.spec, self.ops
        threads, generator = self.threads, self.generator
        with torch_threads(threads):
            results = elementwise_probes(spec, ops, threads, generator)
            for window in sorted({spec.layer_window(i) for i in range(spec.num_layers)}):
                results.append(attention_probe(spec, ops, threads, generator, window, self.kv_cache_format))
        self._op_results = results
        self.seconds += time.perf_counter() - start

    def probe_weights(
        self, linears: Sequence[tuple[str, Linear]] | None = None, blocks: Sequence[BlockProbe] = ()
    ) -> SelfCheckReport:
        """Probe `linears` (`DecoderModel.probe_linears`: one per role and weight-format mix, so every
        format the model uses is probed; None: random dense weights of the spec's shapes) and `blocks`
        (`DecoderModel.probe_blocks`: its first mixture-of-experts MLP, where expert loads change with
        the batch) -> the report of every probe, linears first."""
        self.probe_ops()
        start, ops, threads, generator = time.perf_counter(), self.ops, self.threads, self.generator
        with torch_threads(threads):
            weighted = linear_probes(self.spec, ops, threads, generator, linears)
            weighted.extend(block_probes(blocks, ops, threads, generator))
        self.seconds += time.perf_counter() - start
        return SelfCheckReport(
            results=(*weighted, *(self._op_results or [])),
            dtype=str(self.numerics.dtype).removeprefix("torch."),
            batch_invariant=self.numerics.batch_invariant,
            tile_rows=self.numerics.tile_rows,
            threads=threads,
            seconds=self.seconds,
        )


def run_selfcheck(
    spec: ModelSpec,
    numerics: Numerics,
    threads: int | None,
    linears: Sequence[tuple[str, Linear]] | None = None,
    blocks: Sequence[BlockProbe] = (),
) -> SelfCheckReport:
    """Probe every op the model uses at its real shapes through the backend `numerics` selects, in one
    go (`SelfCheck` says what each pass probes); threads None = torch's current."""
    return SelfCheck(spec, numerics, threads).probe_weights(linears, blocks)
