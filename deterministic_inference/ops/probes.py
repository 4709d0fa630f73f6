"""The self-check's probes: every op of the model at its real shapes, through the model's own ops
backend (random weights and inputs from a fixed seed; `selfcheck.run_selfcheck` runs them).

- row ops (linears incl. the fp32-output logits head, RMSNorm, silu_mul, rotary): a row computed alone
  with one thread vs the same row inside batches of several sizes, at the first, a middle and the last
  position, among random neighbours, with the configured thread count (under `--numerics native` the
  bf16 linears run the AMX-BF16 GEMM, probed also at one 16-row tile and at a tile and a row);
- attention: every query row of a sequence computed in one prefill vs in chunks of 7 and 16, as a
  one-row decode alone, decoded in a group with longer and shorter sequences, and prefilled beside
  another sequence's chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from deterministic_inference.model_spec import ModelSpec
from deterministic_inference.ops.attention import AttentionMetadata, new_kv_cache, write_kv
from deterministic_inference.ops.backend import Numerics, OpsBackend, select_backend
from deterministic_inference.ops.linear import Linear

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


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run a block with `count` torch threads, then restore the previous count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def raw_bits(x: torch.Tensor) -> torch.Tensor:
    """Raw bits, so -0.0 != +0.0 and NaN payloads count (torch.equal on floats would hide them)."""
    x = x.contiguous()
    return x.view(torch.int16) if x.element_size() == 2 else x.view(torch.int32)


def batch_sizes(tile_rows: int, largest: int = 64) -> tuple[int, ...]:
    """Row counts around the padding granularity T (T-1, T+1, 2T+3), small ones, and a large one."""
    return tuple(sorted({2, 3, tile_rows - 1, tile_rows + 1, 2 * tile_rows + 3, largest} - {0, 1}))


def row_probe(
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
        references = [raw_bits(fn(inputs[i : i + 1]))[0] for i in range(count)]
    for size in sizes:
        batch = torch.randn(size, width, generator=generator, dtype=inputs.dtype)  # no fp32 copy first
        placed = {position: (size + k) % count for k, position in enumerate((0, size // 2, size - 1))}
        for position, row in placed.items():
            batch[position] = inputs[row]
        out = raw_bits(fn(batch))
        differs = [at for at, row in placed.items() if not torch.equal(out[at], references[row])]
        del batch, out  # before the next, larger batch: a logits batch is 6.5 MB at M = 33 (49k vocabulary)
        if differs:
            detail = f"row differs at M={size} position {differs[0]}, {threads} threads"
            return ProbeResult(op, shape, False, detail)
    listed = ",".join(str(size) for size in sizes)
    return ProbeResult(op, shape, True, f"{count} rows in batches of M={listed}, {threads} threads")


def linear_probes(
    spec: ModelSpec,
    ops: OpsBackend,
    threads: int,
    generator: torch.Generator,
    linears: Sequence[tuple[str, Linear]] | None = None,
) -> list[ProbeResult]:
    """Each linear of the model, with random input rows: `linears` (name, the model's own Linear: its
    real weights, formats and row orders), else random dense weights of the real shapes (fused qkv, o,
    fused gate_up, down, the fp32 logits head) built by the backend."""
    if linears is None:
        linears = _random_dense_linears(spec, ops, generator)
    results, dtype, tile_rows = [], ops.numerics.dtype, ops.numerics.tile_rows
    for name, linear in linears:
        rows = torch.randn(PROBE_ROWS, linear.in_features, generator=generator).to(dtype)
        formats = "+".join(sorted(set(linear.formats)))
        types = f"{dtype_name(dtype)}->{dtype_name(linear.out_dtype)}"
        shape = f"{linear.in_features}->{linear.out_features}"
        label = f"{name} {shape} {types} {linear.backend} weights {formats}"
        # The logits head's largest batch is one 16-row AMX tile plus a row (probed rows in the tile and
        # in the row kernel): its fp32 outputs are the self-check's largest buffer (3.3 MB at 17 rows
        # of a 49k vocabulary), on top of the whole model. The other linears' 64 rows run 4 tiles.
        sizes = batch_sizes(tile_rows, 17 if name == "lm_head" else 64)
        if linear.native_gemm:  # the AMX-BF16 GEMM's 16-row tiles: one full, and one plus a row
            sizes = tuple(sorted({*sizes, 16, 17}))
            label += " (native numerics: AMX-BF16)"
        results.append(row_probe("linear", label, linear, rows, sizes, threads, generator))
    return results


def _random_dense_linears(
    spec: ModelSpec, ops: OpsBackend, generator: torch.Generator
) -> list[tuple[str, Linear]]:
    q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    shapes = {
        "qkv": (q_size + 2 * kv_size, spec.hidden_size, spec.attention_bias),
        "o_proj": (spec.hidden_size, q_size, False),
        "gate_up": (2 * spec.intermediate_size, spec.hidden_size, False),
        "down": (spec.hidden_size, spec.intermediate_size, False),
        "lm_head": (spec.vocab_size, spec.hidden_size, False),
    }
    dtype, linears = ops.numerics.dtype, []
    for name, (out_features, in_features, has_bias) in shapes.items():
        weight = (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).to(dtype)
        bias = torch.randn(out_features, generator=generator).to(dtype) if has_bias else None
        linears.append((name, ops.logits_head(weight) if name == "lm_head" else ops.linear(weight, bias)))
    return linears


def elementwise_probes(
    spec: ModelSpec, ops: OpsBackend, threads: int, generator: torch.Generator
) -> list[ProbeResult]:
    """RMSNorm with the residual add (and, for qk-norm models, the head-width norm), silu_mul and rotary
    with the KV write, as the model's backend computes them."""
    dtype, name = ops.numerics.dtype, dtype_name(ops.numerics.dtype)
    sizes = batch_sizes(ops.numerics.tile_rows)
    width = spec.hidden_size
    weight = (1.0 + 0.1 * torch.randn(width, generator=generator)).to(dtype)
    probes: dict[str, tuple[RowFn, torch.Tensor]] = {
        f"rms_norm [M, {width}] {name}": (
            norm_fn(ops, weight, spec.rms_norm_eps),
            _rows(2 * width, dtype, generator),
        )
    }
    activation, act_name = (
        (ops.gelu_tanh_mul, "gelu_tanh_mul")
        if spec.hidden_activation == "gelu_tanh"
        else (ops.silu_mul, "silu_mul")
    )
    for inter in mlp_widths(spec):
        probes[f"{act_name} [M, {inter}] {name}"] = (activation, 3 * _rows(2 * inter, dtype, generator))
    if spec.final_logit_softcapping:
        cap = spec.final_logit_softcapping
        probes[f"softcap [M, {spec.vocab_size}] cap {cap:g} fp32"] = (
            lambda x: ops.softcap(x, cap),
            4 * cap * _rows(spec.vocab_size, torch.float32, generator),
        )
    probes |= {
        f"rotary [M, qkv {spec.num_heads}+2x{spec.num_kv_heads}x{spec.head_dim}] {name}": (
            rotary_fn(ops, spec),
            _rows((spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim, dtype, generator),
        ),
    }
    if spec.is_moe:
        experts, k = spec.num_experts, spec.num_experts_per_tok
        # logits on a coarse grid, so rows hold ties (broken by expert index)
        logits = torch.round(4 * torch.randn(PROBE_ROWS, experts, generator=generator)) / 4
        probes[f"moe_route [M, {experts}] top-{k} fp32"] = (route_fn(ops, k, spec.norm_topk_prob), logits)
    if spec.qk_norm:
        head_weight = (1.0 + 0.1 * torch.randn(spec.head_dim, generator=generator)).to(dtype)
        probes[f"rms_norm [M, {spec.head_dim}] {name}"] = (
            lambda x: ops.rms_norm(x, head_weight, spec.rms_norm_eps),
            _rows(spec.head_dim, dtype, generator),
        )
    results = []
    for label, (fn, rows) in probes.items():
        op, shape = label.split(" ", 1)
        results.append(row_probe(op, shape, fn, rows, sizes, threads, generator))
    return results


def mlp_widths(spec: ModelSpec) -> list[int]:
    """The widths silu_mul runs at: the dense MLP's, or the experts' and the shared expert's."""
    if not spec.is_moe:
        return [spec.intermediate_size]
    return sorted({spec.moe_intermediate_size, spec.shared_expert_intermediate_size} - {0})


def route_fn(ops: OpsBackend, k: int, normalize: bool) -> RowFn:
    """[M, E] fp32 router logits -> [M, 2k] fp32: the chosen experts' ids (exact as floats), then their
    weights."""

    def route(logits: torch.Tensor) -> torch.Tensor:
        ids, weights = ops.moe_route(logits.contiguous(), k, normalize)
        return torch.cat((ids.to(torch.float32), weights), dim=1)

    return route


@dataclass(frozen=True)
class BlockProbe:
    """A whole block of the model to probe as a row function, with its real weights."""

    op: str  # e.g. "moe"
    shape: str  # what the report shows: width, experts, formats
    fn: RowFn  # [M, width] -> [M, ...]
    width: int


def block_probes(
    blocks: Sequence[BlockProbe], ops: OpsBackend, threads: int, generator: torch.Generator
) -> list[ProbeResult]:
    """Each block (e.g. a mixture-of-experts MLP: router, routing, every routed expert's GEMMs, the ordered
    sum) on random rows alone vs inside random batches, where each expert's load differs per batch."""
    sizes = batch_sizes(ops.numerics.tile_rows)
    results = []
    for block in blocks:
        rows = _rows(block.width, ops.numerics.dtype, generator)
        results.append(row_probe(block.op, block.shape, block.fn, rows, sizes, threads, generator))
    return results


def _rows(width: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(PROBE_ROWS, width, generator=generator).to(dtype)


def norm_fn(ops: OpsBackend, weight: torch.Tensor, eps: float) -> RowFn:
    """[M, 2W] rows = (hidden, delta) -> [M, 2W] = (normed, hidden + delta)."""
    width = weight.shape[0]

    def norm(x: torch.Tensor) -> torch.Tensor:
        hidden, delta = x[:, :width].clone(), x[:, width:].contiguous()  # the kernel adds in place
        normed, hidden = ops.add_rms_norm(hidden, delta, weight, eps)
        return torch.cat((normed, hidden), dim=1)

    return norm


def rotary_fn(ops: OpsBackend, spec: ModelSpec) -> RowFn:
    """[M, qkv width] rows -> [M, ...] = (rotated q, rotated k and v as read back from a cache); the
    position is a function of the row's own data."""
    heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    # the backend's own tables, as the model builds them (the native backend's come from our kernels:
    # torch's cos / sin would page in ~4 MB of its code that a serving process never runs otherwise)
    rotary = ops.rotary_table(dim, spec.rope_theta, 4096, spec.rope_scaling)

    def rope(x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        positions = (x[:, 0].float().abs() * 1000).long() % 4096
        k_cache, v_cache = new_kv_cache(tokens, 1, kv_heads, dim, x.dtype)
        meta = AttentionMetadata.build([(0, 1, [t]) for t in range(tokens)], block_size=1)
        q = ops.rotary_write_kv(x.contiguous(), positions, rotary, meta, (k_cache, v_cache), heads).to(
            x.dtype
        )
        return torch.cat(
            (q.reshape(tokens, -1), k_cache.reshape(tokens, -1), v_cache.reshape(tokens, -1)), dim=1
        )

    return rope


def dtype_name(dtype: torch.dtype) -> str:
    """fp32 / bf16 (other dtypes by torch's name)."""
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
        window: int = 0,  # a sliding window of this many keys (0: none)
        softcap: float = 0.0,  # the scores' soft cap (0: none)
        cache_dtype: torch.dtype | None = None,  # the cache's format (torch.int8: q8_0); None: `dtype`
    ) -> None:
        heads, kv_heads, head_dim = shape
        self.dtype = dtype
        self.window, self.softcap = window, softcap
        self.block_size = block_size
        per_seq = [-(-length // block_size) for length in lengths]
        self.k_cache, self.v_cache = new_kv_cache(
            sum(per_seq) + 1, block_size, kv_heads, head_dim, dtype if cache_dtype is None else cache_dtype
        )
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
        """One step of (sequence, start, n) items through the backend of `batch_invariant` ->
        {(sequence, position): output row [heads, head_dim] in the world's dtype}."""
        meta = AttentionMetadata.build(
            [(start, n, self.tables[seq]) for seq, start, n in items], self.block_size
        )
        q = torch.cat([self.queries[seq][start : start + n] for seq, start, n in items])  # [T, H, D]
        ops = select_backend(Numerics(self.dtype, batch_invariant, 4))
        scale = q.shape[-1] ** -0.5
        out = ops.attention(q, (self.k_cache, self.v_cache), meta, scale, self.window, self.softcap).view(
            q.shape
        )
        rows = {}
        for seq_rows, (seq, start, n) in zip(meta.sequences, items, strict=True):
            for r in range(n):
                rows[(seq, start + r)] = out[seq_rows.first_row + r]
        return rows


# keys of the window a sliding-window probe uses (it starts inside a block; shorter than the probe)
PROBED_WINDOW = 37


def attention_probe(
    spec: ModelSpec,
    ops: OpsBackend,
    threads: int,
    generator: torch.Generator,
    window: int = 0,
    cache_dtype: torch.dtype | None = None,
) -> ProbeResult:
    """Sequence 0's rows: one prefill (one thread) vs chunks, decode alone, decode and prefill beside
    other sequences. `window` > 0: the model's sliding-window attention, probed with a window of
    min(window, PROBED_WINDOW) keys so that most rows' windows start inside a block (the same code).
    `cache_dtype`: the KV cache's format when it is not the model dtype (torch.int8: the q8_0 path)."""
    length = 2 * 64 + 7
    shape = (spec.num_heads, spec.num_kv_heads, spec.head_dim)
    numerics = ops.numerics
    probed, cap = min(window, PROBED_WINDOW), spec.attn_logit_softcapping
    world = AttentionWorld(
        shape, numerics.dtype, [length, 3 * 64 + 1, 5], generator, window=probed, softcap=cap,
        cache_dtype=cache_dtype,
    )  # fmt: skip
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
    label = f"heads {spec.num_heads}/{spec.num_kv_heads}x{spec.head_dim} {dtype_name(numerics.dtype)}"
    if window:
        label += f" window {window} (probed at {probed})"
    if cap:
        label += f" softcap {cap:g}"
    if cache_dtype is not None and cache_dtype != numerics.dtype:
        label += f" kv cache {'q8_0' if cache_dtype == torch.int8 else dtype_name(cache_dtype)}"
    compared = 0
    for name, plan in plans.items():
        for items in plan:
            for (seq, position), row in world.run(items, numerics.batch_invariant).items():
                if seq != 0:
                    continue
                compared += 1
                if not torch.equal(raw_bits(row), raw_bits(reference[(0, position)])):
                    detail = (
                        f"{name}: position {position} differs from the one-thread prefill, {threads} threads"
                    )
                    return ProbeResult("attention", label, False, detail)
    detail = f"{compared} rows equal across prefill, {', '.join(plans)}; {threads} threads"
    return ProbeResult("attention", label, True, detail)
