"""Op-level costs of the batch-invariant path at SmolLM2-135M shapes (random weights of the real shapes).

Run by hand from the repository root (not a test):
    .venv/bin/python -m bench.bench_ops [--section linear attention activation step quant quant-step engine
        kv-cache] [--threads 1]

Every table compares variants timed side by side in one run (interleaved rounds, best round kept), so
read the ratios; absolute times move with the machine's load.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from deterministic_inference.engine.model_runner import ModelRunner
from deterministic_inference.engine.plan import ScheduledChunk, StepPlan
from deterministic_inference.model.decoder import DecoderModel, Numerics
from deterministic_inference.model.loader import expected_shapes
from deterministic_inference.model_spec import ModelSpec
from deterministic_inference.ops.attention import AttentionMetadata, new_kv_cache, paged_attention
from deterministic_inference.ops.kv_format import Q8_DTYPE, q8_views
from deterministic_inference.ops.linear import Linear
from deterministic_inference.ops.native import NativeKernels, load, native_kernels
from deterministic_inference.ops.quant import FORMATS, QuantLinear
from deterministic_inference.ops.quant_probe import random_weight

SMOLLM2 = ModelSpec(
    architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
    max_position_embeddings=8192, tie_word_embeddings=True,
)  # fmt: skip
BLOCK = 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def best_times(fns: Mapping[str, Callable[[], object]], rounds: int, inner: int = 1) -> dict[str, float]:
    """Best-of-`rounds` milliseconds per call, variants interleaved round by round."""
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / inner * 1e3)
    return best


def print_row(label: str, times: dict[str, float], base: str, columns: tuple[str, ...] = ()) -> None:
    """One markdown table row: each variant's ms and its ratio to `base` (`columns`: order, "-" if absent)."""
    names = columns or tuple(times)
    cells = " | ".join(
        f"{times[n]:.3f} ({times[n] / times[base]:.2f}x)" if n in times else "-" for n in names
    )
    print(f"| {label} | {cells} |", flush=True)


LINEAR_COLUMNS = ("plain", "native")


def bench_linear(rounds: int) -> None:
    """Invariant linears (the compiled bf16 / fp32 GEMMs) vs plain F.linear."""
    shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
    kernels = native_kernels()
    print("\n### linear: ms per call (ratio to plain F.linear of the same dtype)")
    print("| dtype M shape | plain | native |")
    print("|---|---|---|")
    for dtype_name, dtype in DTYPES.items():
        for rows in (1, 8, 32, 128, 512):
            totals: dict[str, float] = {}
            for out_f, in_f in shapes.values():
                weight = (torch.randn(out_f, in_f) / in_f**0.5).to(dtype)
                x = torch.randn(rows, in_f).to(dtype)
                variants = _linear_variants(weight, kernels)
                calls = {name: functools.partial(linear, x) for name, linear in variants.items()}
                times = best_times(calls, rounds, inner=3)
                for key, value in times.items():
                    totals[key] = totals.get(key, 0.0) + value
            print_row(f"{dtype_name} M={rows} layer", totals, "plain", LINEAR_COLUMNS)
    head = torch.randn(SMOLLM2.vocab_size, 576) / 24
    for rows in (1, 8, 32):
        x = torch.randn(rows, 576)
        variants = {"plain": Linear(head, None, batch_invariant=False)}
        # the bf16 model's head: bf16 weight and hidden state, fp32 sums (its fp32 rivals get fp32 inputs)
        native = Linear(
            head.bfloat16(), None, batch_invariant=True, kernels=kernels, out_dtype=torch.float32
        )
        calls = {name: functools.partial(linear, x) for name, linear in variants.items()}
        calls["native"] = functools.partial(native, x.bfloat16())
        times = best_times(calls, rounds)
        print_row(f"fp32-out M={rows} lm_head", times, "plain", LINEAR_COLUMNS)


def _linear_variants(weight: torch.Tensor, kernels: NativeKernels) -> dict[str, Linear]:
    """Plain F.linear and the invariant linear (compiled GEMM of the weight's dtype) for one weight."""
    return {
        "plain": Linear(weight, None, batch_invariant=False),
        "native": Linear(weight, None, batch_invariant=True, kernels=kernels),
    }


def _attention_inputs(
    num_seqs: int, n: int, context: int, dtype: torch.dtype, first_context: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random cache holding `num_seqs` sequences of `context` keys (the first one `first_context`, when
    given) in scattered blocks; each sequence's last `n` tokens are the queries. -> q [S*n, H, D], keys,
    values, metadata."""
    spec = SMOLLM2
    contexts = [first_context or context] + [context] * (num_seqs - 1)
    blocks = [-(-c // BLOCK) for c in contexts]
    num_blocks = sum(blocks) + 1
    k_cache, v_cache = new_kv_cache(num_blocks, BLOCK, spec.num_kv_heads, spec.head_dim, dtype)
    k_cache.copy_(torch.randn(k_cache.shape))  # [blocks, KVH, D, BLOCK]
    v_cache.copy_(torch.randn(v_cache.shape))  # [blocks, KVH, BLOCK, D]
    ids = (torch.randperm(num_blocks - 1) + 1).tolist()
    starts = [sum(blocks[:i]) for i in range(num_seqs)]
    tables = [ids[start : start + count] for start, count in zip(starts, blocks, strict=True)]
    rows = [(c - n, n, table) for c, table in zip(contexts, tables, strict=True)]
    meta = AttentionMetadata.build(rows, BLOCK)
    q = torch.randn(num_seqs * n, spec.num_heads, spec.head_dim).to(dtype)
    return q, k_cache, v_cache, meta


def bench_attention(rounds: int, libraries: Sequence[Path] = ()) -> None:
    """Invariant attention (the compiled kernel) vs per-sequence SDPA (batch_invariant=False), one layer.
    `libraries`: built kernel libraries to time side by side instead of this process's build (e.g. one
    -march level's builds of two source versions, from the kernel cache)."""
    # (sequences, query tokens each, context, the first sequence's context): decode, a decode step with one
    # long sequence among short ones (how the threads share the work out), prefill
    cases = [(32, 1, 256, 0), (32, 1, 192, 4096), (4, 128, 128, 0)]
    builds = {path.stem: load(path) for path in libraries} or {"native": native_kernels()}
    names = " | ".join(builds)
    print(f"\n### attention, one layer: ms per call (ratio to per-sequence SDPA); kernels {names}")
    print(f"| dtype S x n @ context | sdpa | {names} |\n|---|---|{'---|' * len(builds)}")
    for dtype_name, dtype in DTYPES.items():
        for num_seqs, n, context, first_context in cases:
            q, k_cache, v_cache, meta = _attention_inputs(num_seqs, n, context, dtype, first_context)
            scale = SMOLLM2.head_dim**-0.5
            fns = {
                name: functools.partial(
                    paged_attention, q, k_cache, v_cache, meta, scale=scale, kernels=choice
                )
                for name, choice in (("sdpa", None), *builds.items())
            }
            label = f"{dtype_name} {num_seqs}x{n} @ {context}" + (
                f", one @ {first_context}" if first_context else ""
            )
            print_row(label, best_times(fns, rounds), "sdpa")


def bench_kv_cache(rounds: int) -> None:
    """The attention kernel over a bf16 KV cache vs a q8_0 one (--kv-cache-dtype), one layer: decode rows
    of 32 streams, one decode row and one 64-token chunk at a 6k context."""
    cases = [(32, 1, 256), (32, 1, 1024), (1, 1, 6144), (1, 64, 6144)]
    kernels, scale = native_kernels(), SMOLLM2.head_dim**-0.5
    print(f"\n### attention over the KV cache, one layer: ms per call (ratio to bf16); {kernels.digest}")
    print("| S x n @ context | bf16 cache | q8_0 cache |\n|---|---|---|")
    for num_seqs, n, context in cases:
        q, k_cache, v_cache, meta = _attention_inputs(num_seqs, n, context, torch.bfloat16)
        k8, v8 = new_kv_cache(k_cache.shape[0], BLOCK, SMOLLM2.num_kv_heads, SMOLLM2.head_dim, Q8_DTYPE)
        views = q8_views(k8, v8)
        for values in (views.key_values, views.value_values):
            values.copy_(torch.randint(-127, 128, values.shape, dtype=torch.int8))
        for scales in (views.key_scales, views.value_scales):
            scales.copy_(torch.rand(scales.shape) / 64)
        fns = {
            name: functools.partial(paged_attention, q, keys, values, meta, scale=scale, kernels=kernels)
            for name, keys, values in (("bf16", k_cache, v_cache), ("q8_0", k8, v8))
        }
        print_row(f"{num_seqs}x{n} @ {context}", best_times(fns, rounds), "bf16")


def bench_activation(rounds: int) -> None:
    """silu_mul: the compiled kernel (invariant) vs F.silu(gate) * up."""
    kernels = native_kernels()
    print("\n### silu_mul [M, 1536]: ms per call (ratio to F.silu * up)")
    print("| dtype M | plain | native |\n|---|---|---|")
    for dtype_name, dtype in DTYPES.items():
        for rows in (8, 32, 512):
            gate_up = (torch.randn(rows, 3072) * 3).to(dtype)
            gate, up = gate_up[:, :1536], gate_up[:, 1536:]
            fns = {
                "plain": functools.partial(_plain_silu_mul, gate, up),
                "native": functools.partial(kernels.silu_mul, gate_up),
            }
            print_row(f"{dtype_name} M={rows}", best_times(fns, rounds, inner=5), "plain")


def _plain_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The plain formulation (the torch backend's): F.silu(gate) * up."""
    return F.silu(gate) * up


def random_weights(spec: ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 weights of every shape the architecture needs (norm weights near 1)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(spec).items():
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        else:
            weights[name] = torch.randn(shape, generator=generator) / shape[-1] ** 0.5
    return weights


def _step_plan(num_seqs: int, n: int, context: int) -> StepPlan:
    """Each of `num_seqs` sequences computes its last `n` of `context` tokens (disjoint KV blocks)."""
    blocks_per_seq = -(-context // BLOCK)
    chunks = tuple(
        ScheduledChunk(
            request_id=f"r{seq}",
            token_ids=tuple(range(100, 100 + n)),
            start_position=context - n,
            block_ids=tuple(range(1 + seq * blocks_per_seq, 1 + (seq + 1) * blocks_per_seq)),
            sample=True,
            all_logits=False,
        )  # fmt: skip
        for seq in range(num_seqs)
    )
    return StepPlan(step_id=0, chunks=chunks)


def bench_step(rounds: int, cases: list[tuple[int, int, int]]) -> None:
    """One full model step (30 layers + logits head) for several numerics, ratio to plain bf16."""
    weights = random_weights(SMOLLM2)
    numerics = {
        "plain-bf16": Numerics(torch.bfloat16, False, 4),
        "inv-bf16-T4": Numerics(torch.bfloat16, True, 4),
        "inv-bf16-T8": Numerics(torch.bfloat16, True, 8),
        "plain-fp32": Numerics(torch.float32, False, 4),
        "inv-fp32-T4": Numerics(torch.float32, True, 4),
    }
    runners = {}
    for name, numeric in numerics.items():
        model = DecoderModel(SMOLLM2, weights, numeric, max_positions=2048)
        runners[name] = ModelRunner(model, num_blocks=32 * 2048 // BLOCK // 4 + 1, block_size=BLOCK)
    print("\n### model step (30 layers + head): ms per step (ratio to plain-bf16)")
    print("| S x n @ context | " + " | ".join(numerics) + " |\n|---|" + "---|" * len(numerics))
    for num_seqs, n, context in cases:
        plan = _step_plan(num_seqs, n, context)
        fns = {name: functools.partial(runner.execute, plan) for name, runner in runners.items()}
        print_row(f"{num_seqs}x{n} @ {context}", best_times(fns, rounds), "plain-bf16")


def bench_engine_numerics(concurrency: int, prompt_len: int, output_len: int, with_hf: bool) -> None:
    """Whole-engine greedy throughput on the default model for several numerics (and HF transformers)."""
    from bench.bench_engine import bench_hf, make_prompts
    from bench.hf_copy import write_bf16_hf_dir
    from deterministic_inference.config import EngineConfig
    from deterministic_inference.engine.engine import Engine
    from deterministic_inference.engine.sampling_params import SamplingParams
    from deterministic_inference.model.loader import load_model

    loaded = load_model(None)
    prompts = make_prompts(concurrency, prompt_len, loaded.spec.vocab_size)
    variants: dict[str, dict[str, Any]] = {
        "inv bf16 T=4": {"linear_tile_rows": 4},
        "inv bf16 T=8": {"linear_tile_rows": 8},
        "plain bf16": {"batch_invariant": False},
    }
    print(f"\n### engine, {concurrency} streams x ({prompt_len} prompt + {output_len} generated): tokens/s")
    print("| numerics | generated tok/s |\n|---|---|")
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for name, fields in variants.items():
        config = EngineConfig(dtype="bfloat16", max_num_seqs=max(64, concurrency), selfcheck=False, **fields)
        engine = Engine(config, loaded=loaded)
        engine.generate([prompts[0][:16]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        generated = sum(len(output.outputs[0].token_ids) for output in outputs)
        print(f"| {name} | {generated / (time.perf_counter() - start):.1f} |", flush=True)
    if with_hf:
        with tempfile.TemporaryDirectory() as scratch:  # HF runs on a bf16 HF copy of the same weights
            run = bench_hf(str(write_bf16_hf_dir(loaded, Path(scratch) / "hf")), [prompts], output_len)
        print(f"| HF transformers bf16 generate | {run['tokens'] / run['seconds']:.1f} |", flush=True)


QUANT_SHAPES = {  # Llama-3.2-1B: attention projections, FFN gate/up, FFN down
    "2048x2048": (2048, 2048),
    "8192x2048": (8192, 2048),
    "2048x8192": (2048, 8192),
}
STREAM_BYTES = 64 << 20  # weight copies per variant: more than the L3 cache, so M = 1 reads from memory


def bench_quant(rounds: int) -> None:
    """Quantized-weight GEMM per format vs the bf16 native GEMM at Llama-3.2-1B shapes, M = 1, 32, 512.
    Each call takes the next of several weight copies, so M = 1 streams its weight from memory as a real
    decode step does. Cells: ms per call (ratio to bf16; GB/s of weight read at M = 1, else GFLOP/s)."""
    kernels = native_kernels()
    generator = torch.Generator().manual_seed(0)
    print("\n### quantized GEMM: ms per call (ratio to bf16 native GEMM; M=1: GB/s of weights, else GFLOP/s)")
    print("| shape M | bf16 | " + " | ".join(FORMATS) + " |\n|---|---|" + "---|" * len(FORMATS))
    for label, (n, k) in QUANT_SHAPES.items():
        calls, weight_bytes = _quant_variants(kernels, n, k, generator)
        for rows in (1, 32, 512):
            x = torch.randn(rows, k, generator=generator).bfloat16()
            times = best_times({name: functools.partial(call, x) for name, call in calls.items()}, rounds, 4)
            cells = []
            for name, ms in times.items():
                rate = (weight_bytes[name] if rows == 1 else 2 * rows * n * k) / ms / 1e6  # G per s
                cells.append(f"{ms:.3f} ({ms / times['bf16']:.2f}x; {rate:.0f})")
            print(f"| {label} M={rows} | " + " | ".join(cells) + " |", flush=True)


def _quant_variants(
    kernels: NativeKernels, n: int, k: int, generator: torch.Generator
) -> tuple[dict[str, Callable[[torch.Tensor], torch.Tensor]], dict[str, int]]:
    """name -> a call cycling over weight copies of that format ("bf16": the native GEMM), and its bytes."""
    calls: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    weight_bytes = {"bf16": n * k * 2}
    packed = [
        kernels.pack_bf16((torch.randn(n, k, generator=generator) / k**0.5).bfloat16())
        for _ in range(-(-STREAM_BYTES // weight_bytes["bf16"]))
    ]
    calls["bf16"] = _cycling(
        [functools.partial(kernels.gemm_bf16, packed=p, out_features=n, bias=None, out_dtype=torch.bfloat16)
         for p in packed]
    )  # fmt: skip
    for name, fmt in FORMATS.items():
        weight_bytes[name] = n * k // fmt.block_values * fmt.block_bytes
        copies = -(-STREAM_BYTES // weight_bytes[name])
        weights = [random_weight(name, n, k, generator) for _ in range(copies)]
        linears = [QuantLinear(kernels, [w], bias=None, out_dtype=torch.bfloat16) for w in weights]
        calls[name] = _cycling(linears)
    return calls, weight_bytes


# the benchmark model maker's default shape: Llama-3.2-1B with the default model's tokenizer (vocab 49152)
LLAMA_1B = {"hidden": 2048, "ffn": 8192, "kv": 512, "layers": 16, "vocab": 49152}


def bench_quant_step(rounds: int, formats: tuple[str, ...]) -> None:
    """The linears of one decode step (M = 1) of a Llama-3.2-1B-shaped model, all in one format: per layer
    qkv (3 parts), o, gate_up (2 parts), down, then the tied head (fp32 out). ms per step = the weights'
    share of a decode step; its inverse bounds tokens/s from above."""
    kernels = native_kernels()
    generator = torch.Generator().manual_seed(0)
    print("\n### decode-step linears, Llama-3.2-1B shapes (16 layers + head), M = 1: ms per step")
    print("| format | weights MB | ms per step | GB/s | steps/s |\n|---|---|---|---|---|")
    for name in formats:
        linears = _step_linears(kernels, name, generator)
        widths = {linear.in_features for linear in linears}
        inputs = {k: torch.randn(1, k, generator=generator).bfloat16() for k in widths}
        calls = [functools.partial(linear, inputs[linear.in_features]) for linear in linears]
        ms = best_times({"step": functools.partial(_run_all, calls)}, rounds)["step"]
        mb = sum(part.data.numel() for linear in linears for part in linear.parts) / 1e6
        print(f"| {name} | {mb:.0f} | {ms:.1f} | {mb / ms:.1f} | {1e3 / ms:.1f} |", flush=True)


def _step_linears(kernels: NativeKernels, name: str, generator: torch.Generator) -> list[QuantLinear]:
    h, ffn, kv, vocab = LLAMA_1B["hidden"], LLAMA_1B["ffn"], LLAMA_1B["kv"], LLAMA_1B["vocab"]
    shapes = [[(h, h), (kv, h), (kv, h)], [(h, h)], [(ffn, h), (ffn, h)], [(h, ffn)]] * LLAMA_1B["layers"]
    linears = []
    for parts in [*shapes, [(vocab, h)]]:
        weights = [random_weight(name, n, k, generator) for n, k in parts]
        out_dtype = torch.float32 if parts[0][0] == vocab else torch.bfloat16  # the head: fp32 logits
        linears.append(QuantLinear(kernels, weights, bias=None, out_dtype=out_dtype))
    return linears


def _run_all(calls: list[Callable[[], object]]) -> None:
    for call in calls:
        call()


def _cycling(fns: list[Callable[[torch.Tensor], torch.Tensor]]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function calling the next of `fns` each time (different weights: no cache reuse between calls)."""
    position = [0]

    def call(x: torch.Tensor) -> torch.Tensor:
        fn = fns[position[0] % len(fns)]
        position[0] += 1
        return fn(x)

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--section", nargs="+", default=["linear", "attention", "activation", "step", "quant"]
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=32, help="engine section: streams")
    parser.add_argument("--no-hf", action="store_true", help="engine section: skip HF transformers")
    parser.add_argument(
        "--libraries", type=Path, nargs="*", default=[], help="attention section: kernel builds to compare"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    if "linear" in args.section:
        bench_linear(args.rounds)
    if "attention" in args.section:
        bench_attention(args.rounds, args.libraries)
    if "activation" in args.section:
        bench_activation(args.rounds)
    if "step" in args.section:
        steps = [(1, 1, 256), (8, 1, 256), (32, 1, 128), (32, 1, 512), (4, 128, 128), (1, 512, 512)]
        bench_step(max(2, args.rounds // 2), steps)
    if "quant" in args.section:
        bench_quant(args.rounds)
    if "quant-step" in args.section:  # not in the default sections: ~1 GB of weights per format
        bench_quant_step(args.rounds, ("Q4_0", "Q8_0", "Q4_K"))
    if "kv-cache" in args.section:  # not in the default sections (issue 36's KV cache formats)
        bench_kv_cache(args.rounds)
    if "engine" in args.section:  # not in the default sections: several minutes
        bench_engine_numerics(args.concurrency, 128, 128, not args.no_hf)


if __name__ == "__main__":
    main()
