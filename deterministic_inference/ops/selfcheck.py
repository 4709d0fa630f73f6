"""Start-up self-check: probe every batch-invariant op at a model's real shapes on this machine.

Invariance is a property of the kernels torch picks on this CPU, not of our code alone, so before
serving in invariant mode the engine runs these probes (random weights of the real shapes; a few
seconds for SmolLM2-135M) and refuses to start, naming the op and shape, if any probe differs:

- row ops (linears incl. the fp32-output logits head, RMSNorm, silu_mul, rotary): a row computed alone with
  one thread vs the same row inside batches of several sizes, at the first, a middle and the last
  position, among random neighbours, with the configured thread count;
- exp: its scalar and vectorised kernels agree (silu_mul relies on it);
- attention: every query row of a sequence computed in one prefill vs in chunks of 7 and 16, as a
  one-row decode alone, decoded in a group with longer and shorter sequences, and prefilled beside
  another sequence's chunk.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from deterministic_inference.errors import SelfCheckError
from deterministic_inference.model.llama import Numerics
from deterministic_inference.model.spec import ModelSpec
from deterministic_inference.ops.activation import silu_mul
from deterministic_inference.ops.attention import AttentionMetadata, new_kv_cache, paged_attention, write_kv
from deterministic_inference.ops.linear import Linear
from deterministic_inference.ops.native import NativeKernels, native_kernels
from deterministic_inference.ops.norm import rms_norm
from deterministic_inference.ops.rope import RotaryTable

PROBE_ROWS = 4  # random rows probed per row op (whether a kernel differs can depend on the data)
BLOCK_SIZE = 16  # KV-cache block size of the attention probe (the engine's default)
RowFn = Callable[[torch.Tensor], torch.Tensor]  # [M, K] -> [M, N]


@dataclass(frozen=True)
class ProbeResult:
    """One probe: the op, its shape, whether every compared row was bitwise equal, and what was run."""

    op: str
    shape: str
    ok: bool
    detail: str


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


def run_selfcheck(spec: ModelSpec, numerics: Numerics, threads: int | None) -> SelfCheckReport:
    """Probe every op the model uses at its real shapes with `numerics`; threads None = torch's current.

    References are computed with one thread, probes with `threads`, so a pass also shows the thread
    count does not change bits. Random data comes from a fixed seed (the check itself is reproducible).
    """
    probe_threads = threads if threads is not None else torch.get_num_threads()
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    results: list[ProbeResult] = []
    with torch_threads(probe_threads):
        results.extend(_linear_probes(spec, numerics, probe_threads, generator))
        results.extend(_elementwise_probes(spec, numerics, probe_threads, generator))
        results.append(_exp_probe(generator))
        results.append(_attention_probe(spec, numerics, probe_threads, generator))
    return SelfCheckReport(
        results=tuple(results),
        dtype=str(numerics.dtype).removeprefix("torch."),
        batch_invariant=numerics.batch_invariant,
        tile_rows=numerics.tile_rows,
        threads=probe_threads,
        seconds=time.perf_counter() - start,
    )


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run a block with `count` torch threads, then restore the previous count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """Raw bits, so -0.0 != +0.0 and NaN payloads count (torch.equal on floats would hide them)."""
    x = x.contiguous()
    return x.view(torch.int16) if x.element_size() == 2 else x.view(torch.int32)


def batch_sizes(tile_rows: int, largest: int = 64) -> tuple[int, ...]:
    """Row counts around the padding granularity T (T-1, T+1, 2T+3), small ones, and a large one."""
    return tuple(sorted({2, 3, tile_rows - 1, tile_rows + 1, 2 * tile_rows + 3, largest} - {0, 1}))


def _row_probe(
    op: str,
    shape: str,
    fn: RowFn,
    inputs: torch.Tensor,  # [R, K] probe rows
    sizes: tuple[int, ...],
    threads: int,
    generator: torch.Generator,
) -> ProbeResult:
    """Rows of `inputs` alone (one thread) vs inside a random batch of each size, probe rows placed at
    the first, a middle and the last position (one call per size)."""
    width, count = inputs.shape[1], inputs.shape[0]
    with torch_threads(1):
        references = [_bits(fn(inputs[i : i + 1]))[0] for i in range(count)]
    for size in sizes:
        batch = torch.randn(size, width, generator=generator).to(inputs.dtype)
        placed = {position: (size + k) % count for k, position in enumerate((0, size // 2, size - 1))}
        for position, row in placed.items():
            batch[position] = inputs[row]
        out = _bits(fn(batch))
        for position, row in placed.items():
            if not torch.equal(out[position], references[row]):
                detail = f"row differs at M={size} position {position}, {threads} threads"
                return ProbeResult(op, shape, False, detail)
    listed = ",".join(str(size) for size in sizes)
    return ProbeResult(op, shape, True, f"{count} rows in batches of M={listed}, {threads} threads")


def _linear_probes(
    spec: ModelSpec, numerics: Numerics, threads: int, generator: torch.Generator
) -> list[ProbeResult]:
    """Each distinct linear of the model (fused qkv, o, fused gate_up, down) and the fp32 logits head."""
    q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    shapes = {
        "qkv": (q_size + 2 * kv_size, spec.hidden_size, spec.attention_bias),
        "o_proj": (spec.hidden_size, q_size, False),
        "gate_up": (2 * spec.intermediate_size, spec.hidden_size, False),
        "down": (spec.hidden_size, spec.intermediate_size, False),
        "lm_head": (spec.vocab_size, spec.hidden_size, False),
    }
    results, dtype, tile_rows = [], numerics.dtype, numerics.tile_rows
    kernels = native_kernels() if numerics.batch_invariant else None
    for name, (out_features, in_features, has_bias) in shapes.items():
        weight = (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).to(dtype)
        bias = torch.randn(out_features, generator=generator).to(dtype) if has_bias else None
        out_dtype = torch.float32 if name == "lm_head" else dtype
        linear = Linear(weight, bias, tile_rows=tile_rows, batch_invariant=numerics.batch_invariant,
                        kernels=kernels, out_dtype=out_dtype)  # fmt: skip
        rows = torch.randn(PROBE_ROWS, in_features, generator=generator).to(dtype)
        tile = "" if linear.backend == "native" else f" T={tile_rows}"
        types = f"{_dtype_name(dtype)}->{_dtype_name(out_dtype)}"
        label = f"{name} {in_features}->{out_features} {types} {linear.backend}{tile}"
        sizes = batch_sizes(tile_rows, 33 if name == "lm_head" else 64)
        results.append(_row_probe("linear", label, linear, rows, sizes, threads, generator))
    return results


def _elementwise_probes(
    spec: ModelSpec, numerics: Numerics, threads: int, generator: torch.Generator
) -> list[ProbeResult]:
    """RMSNorm with the residual add (and, for qk-norm models, the head-width norm), silu_mul and rotary
    with the KV write: the compiled kernels in invariant mode, the torch ops otherwise."""
    dtype, name = numerics.dtype, _dtype_name(numerics.dtype)
    kernels = native_kernels() if numerics.batch_invariant else None
    sizes = batch_sizes(numerics.tile_rows)
    width, inter = spec.hidden_size, spec.intermediate_size
    weight = (1.0 + 0.1 * torch.randn(width, generator=generator)).to(dtype)
    probes: dict[str, tuple[RowFn, torch.Tensor]] = {
        f"rms_norm [M, {width}] {name}": (
            _norm_fn(kernels, weight, spec.rms_norm_eps),
            _rows(2 * width, dtype, generator),
        ),
        f"silu_mul [M, {inter}] {name}": (_silu_fn(kernels, inter), 3 * _rows(2 * inter, dtype, generator)),
        f"rotary [M, qkv {spec.num_heads}+2x{spec.num_kv_heads}x{spec.head_dim}] {name}": (
            _rotary_fn(kernels, spec),
            _rows((spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim, dtype, generator),
        ),
    }
    if spec.qk_norm:
        head_weight = (1.0 + 0.1 * torch.randn(spec.head_dim, generator=generator)).to(dtype)
        probes[f"rms_norm [M, {spec.head_dim}] {name}"] = (
            lambda x: rms_norm(x, head_weight, spec.rms_norm_eps),
            _rows(spec.head_dim, dtype, generator),
        )
    results = []
    for label, (fn, rows) in probes.items():
        op, shape = label.split(" ", 1)
        results.append(_row_probe(op, shape, fn, rows, sizes, threads, generator))
    return results


def _rows(width: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(PROBE_ROWS, width, generator=generator).to(dtype)


def _norm_fn(kernels: NativeKernels | None, weight: torch.Tensor, eps: float) -> RowFn:
    """[M, 2W] rows = (hidden, delta) -> [M, 2W] = (normed, hidden + delta)."""
    width = weight.shape[0]

    def norm(x: torch.Tensor) -> torch.Tensor:
        hidden, delta = x[:, :width].clone(), x[:, width:].contiguous()  # the kernel adds in place
        if kernels is None:
            hidden = hidden + delta
            return torch.cat((rms_norm(hidden, weight, eps), hidden), dim=1)
        return torch.cat((kernels.add_rms_norm(hidden, delta, weight, eps), hidden), dim=1)

    return norm


def _silu_fn(kernels: NativeKernels | None, inter: int) -> RowFn:
    """[M, 2I] gate_up rows -> [M, I]."""
    if kernels is None:
        return lambda x: silu_mul(x[:, :inter], x[:, inter:], batch_invariant=False)
    return kernels.silu_mul


def _rotary_fn(kernels: NativeKernels | None, spec: ModelSpec) -> RowFn:
    """[M, qkv width] rows -> [M, ...] = (rotated q, rotated k and v as read back from a cache); the
    position is a function of the row's own data."""
    heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    rotary = RotaryTable(dim, spec.rope_theta, 4096, spec.rope_scaling)

    def rope(x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        positions = (x[:, 0].float().abs() * 1000).long() % 4096
        k_cache, v_cache = new_kv_cache(tokens, 1, kv_heads, dim, x.dtype)
        meta = AttentionMetadata.build([(0, 1, [t]) for t in range(tokens)], block_size=1)
        q, k, v = (
            x[:, : heads * dim],
            x[:, heads * dim : (heads + kv_heads) * dim],
            x[:, (heads + kv_heads) * dim :],
        )
        if kernels is None:
            q = rotary.apply(q.reshape(tokens, heads, dim), positions)
            k = rotary.apply(k.reshape(tokens, kv_heads, dim), positions)
            write_kv(k_cache, v_cache, k, v.reshape(tokens, kv_heads, dim), meta)
        else:
            q = kernels.rotary_write_kv(
                x.contiguous(), positions, rotary.cos, rotary.sin, meta.write_blocks, meta.write_offsets,
                k_cache, v_cache, heads,
            ).to(x.dtype)  # fmt: skip
        return torch.cat(
            (q.reshape(tokens, -1), k_cache.reshape(tokens, -1), v_cache.reshape(tokens, -1)), dim=1
        )

    return rope


def _exp_probe(generator: torch.Generator) -> ProbeResult:
    """torch.exp's scalar kernel (strided input) vs its vectorised kernel (contiguous input)."""
    values = torch.randn(1 << 16, 2, generator=generator) * 12
    strided, contiguous = values[:, 0], values[:, 0].contiguous()
    differ = int((_bits(torch.exp(strided)) != _bits(torch.exp(contiguous))).sum())
    detail = f"{differ} of {strided.numel()} values differ" if differ else f"{strided.numel()} values equal"
    return ProbeResult("exp", "scalar vs vector kernel fp32", differ == 0, detail)


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype))


class AttentionWorld:
    """Random K/V of a few sequences written to scattered cache blocks, and random queries for every
    position, in the engine's cache layout (also used by the attention tests)."""

    def __init__(
        self,
        shape: tuple[int, int, int],  # (heads, kv_heads, head_dim)
        dtype: torch.dtype,
        lengths: list[int],
        generator: torch.Generator,
        block_size: int = BLOCK_SIZE,
    ) -> None:
        heads, kv_heads, head_dim = shape
        self.block_size = block_size
        per_seq = [-(-length // block_size) for length in lengths]
        self.k_cache, self.v_cache = new_kv_cache(sum(per_seq) + 1, block_size, kv_heads, head_dim, dtype)
        order = torch.randperm(sum(per_seq) + 1, generator=generator).tolist()
        self.tables = []
        for count, length in zip(per_seq, lengths, strict=True):
            self.tables.append(order[:count])
            order = order[count:]
            keys, values = (
                torch.randn(length, kv_heads, head_dim, generator=generator).to(dtype) for _ in "kv"
            )
            meta = AttentionMetadata.build([(0, length, self.tables[-1])], block_size)
            write_kv(self.k_cache, self.v_cache, keys, values, meta)
        self.queries = [
            (2 * torch.randn(length, heads, head_dim, generator=generator)).to(dtype) for length in lengths
        ]

    def run(
        self, items: list[tuple[int, int, int]], batch_invariant: bool
    ) -> dict[tuple[int, int], torch.Tensor]:
        """One step of (sequence, start, n) items -> {(sequence, position): output row [heads, head_dim]}."""
        meta = AttentionMetadata.build(
            [(start, n, self.tables[seq]) for seq, start, n in items], self.block_size
        )
        q = torch.cat([self.queries[seq][start : start + n] for seq, start, n in items])
        kernels = native_kernels() if batch_invariant else None
        out = paged_attention(q, self.k_cache, self.v_cache, meta, scale=q.shape[-1] ** -0.5, kernels=kernels)
        rows = {}
        for seq_rows, (seq, start, n) in zip(meta.sequences, items, strict=True):
            for r in range(n):
                rows[(seq, start + r)] = out[seq_rows.first_row + r]
        return rows


def _attention_probe(
    spec: ModelSpec, numerics: Numerics, threads: int, generator: torch.Generator
) -> ProbeResult:
    """Sequence 0's rows: one prefill (one thread) vs chunks, decode alone, decode and prefill beside
    other sequences."""
    length = 2 * 64 + 7
    shape = (spec.num_heads, spec.num_kv_heads, spec.head_dim)
    world = AttentionWorld(shape, numerics.dtype, [length, 3 * 64 + 1, 5], generator)
    with torch_threads(1):
        reference = world.run([(0, 0, length)], numerics.batch_invariant)
    positions = sorted({0, 1, 15, 16, 17, 63, 64, 65, 128, length - 1})
    plans: dict[str, list[list[tuple[int, int, int]]]] = {
        f"chunks of {size}": [[(0, s, min(size, length - s))] for s in range(0, length, size)]
        for size in (7, 16)
    }
    plans["decode alone"] = [[(0, p, 1)] for p in positions]
    plans["decode beside others"] = [[(1, 3 * 64, 1), (0, p, 1), (2, 4, 1)] for p in positions]
    plans["prefill beside another sequence"] = [[(1, 3 * 64 + 1 - length, length), (0, 0, length), (2, 0, 5)]]
    compared = 0
    for name, plan in plans.items():
        for items in plan:
            for (seq, position), row in world.run(items, numerics.batch_invariant).items():
                if seq != 0:
                    continue
                compared += 1
                if not torch.equal(_bits(row), _bits(reference[(0, position)])):
                    detail = (
                        f"{name}: position {position} differs from the one-thread prefill, {threads} threads"
                    )
                    return ProbeResult("attention", _attention_shape(spec, numerics), False, detail)
    detail = f"{compared} rows equal across prefill, {', '.join(plans)}; {threads} threads"
    return ProbeResult("attention", _attention_shape(spec, numerics), True, detail)


def _attention_shape(spec: ModelSpec, numerics: Numerics) -> str:
    return f"heads {spec.num_heads}/{spec.num_kv_heads}x{spec.head_dim} {_dtype_name(numerics.dtype)}"
