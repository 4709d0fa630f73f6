"""Speculative decoding (ngram prompt lookup) vs plain decoding, on copy-heavy prompts and on free text,
threads 1 and 2, in one run: a single stream, or `--streams N` requests together.

Run by hand from the repository root:
    .venv/bin/python -m bench.bench_spec [--model default] [--threads 1 2] [--output-len 96] [--repeats 3] \
        [--prompts "copy: repeat a passage" "free text"] [--streams 32] [--disable-by-batch-size N]

Prompt kinds: a passage to quote and summarise, a one-function code edit written as a completion, a
passage to repeat, free text, and "copy: code edit (chat)": a user's request to rename a variable in two
short functions and return the whole code, rendered by the model's chat template (as
/v1/chat/completions sends it; llama.cpp gets the same rendered text).

With --streams N, each measurement runs N requests of the same prompt kind together (each prompt starts
with its own "Request i." line), and the figure is their aggregate tokens/s.

Two engines on the same loaded model, one plain and one with
`{"method": "ngram", "num_speculative_tokens": K}`; each request greedy (end-of-sequence ignored) from an
empty prefix cache. Plain and speculative runs alternate, so both see the same load on a shared machine;
the ratio of the medians (tokens / wall time of the request, prefill included) is the figure to read.
Every speculative output is checked to be bitwise the plain one (token ids and logprob bits) and the
acceptance counters are printed. With --llama-python PATH (a Python with llama-cpp-python), two more
columns per row, single stream only: llama.cpp plain and llama.cpp with llama-cpp-python's prompt-lookup
decoding (`LlamaPromptLookupDecoding(num_pred_tokens=K)`), each in its own process
(bench/llama_cpp_worker.py), on the same GGUF file and prompts, greedy, end-of-sequence banned, from an
empty cache, alternated with ours; "same text" says the lookup run's text equals llama.cpp plain's.
"""

from __future__ import annotations

import argparse
import statistics
import struct
import time

import torch

from bench.llama_cpp_worker import LlamaCppWorker
from deterministic_inference.model.tokenizer import Tokenizer

PASSAGE = (
    "The lighthouse stood at the edge of the northern cliffs for two hundred years. Every night its keeper "
    "climbed the one hundred and twelve steps, trimmed the wick, wound the clockwork that turned the lens, "
    "and wrote the weather in a leather book. Ships passing the point saw the light sweep the water "
    "every ten seconds, and knew where the rocks were."
)
CODE = '''def moving_average(values, window):
    result = []
    for index in range(len(values) - window + 1):
        chunk = values[index:index + window]
        result.append(sum(chunk) / window)
    return result
'''
TWO_FUNCTIONS = '''def read_scores(path):
    scores = {}
    with open(path) as handle:
        for line in handle:
            name, value = line.strip().split(",")
            scores[name] = int(value)
    return scores


def best_player(scores):
    best_name = None
    best_value = -1
    for name, value in scores.items():
        if value > best_value:
            best_name = name
            best_value = value
    return best_name
'''
# sent as a chat user message (rendered with the model's chat template, as /v1/chat/completions does)
CHAT_PROMPTS = {
    "copy: code edit (chat)": "Rename the variable `scores` to `points` in this code and return the whole "
    f"code.\n\n```python\n{TWO_FUNCTIONS}```",
}
PROMPTS = {
    "copy: quote-and-summarise": f"{PASSAGE}\n\nQuote the passage above word for word, then summarise it.\n"
    "Quote: The lighthouse stood",
    "copy: code edit": f"{CODE}\nRewrite the function above with the variable `chunk` renamed to `part`. "
    "Keep everything else the same.\n\n```python\ndef moving_average(values, window):",
    "copy: repeat a passage": f"{PASSAGE}\n\nRepeat the passage above exactly.\n\n{PASSAGE[:60]}",
    "free text": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
KINDS = [*PROMPTS, *CHAT_PROMPTS]


def prompt_text(kind: str, tokenizer: Tokenizer) -> str:
    """The prompt text of a kind: as written, or a chat message rendered by the model's template."""
    if kind in PROMPTS:
        return PROMPTS[kind]
    return tokenizer.apply_chat_template([{"role": "user", "content": CHAT_PROMPTS[kind]}])


def bits(values: list[float]) -> bytes:
    return b"".join(struct.pack("<f", v) for v in values)


def one_request(engine: object, prompt: str, output_len: int) -> tuple[float, tuple[list[int], bytes]]:
    """Tokens/s of one greedy request from an empty prefix cache, and its (tokens, logprob bits)."""
    from deterministic_inference.engine.engine import Engine
    from deterministic_inference.engine.sampling_params import SamplingParams

    assert isinstance(engine, Engine)
    engine.flush_prefix_cache()
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    output = engine.generate([prompt], params)[0].outputs[0]
    seconds = time.perf_counter() - start
    return len(output.token_ids) / seconds, (output.token_ids, bits(output.logprobs))


def many_requests(
    engine: object, prompt: str, streams: int, output_len: int
) -> tuple[float, list[tuple[list[int], bytes]]]:
    """Aggregate tokens/s of `streams` greedy requests run together from an empty prefix cache (each
    prompt starts with its own stream number, so they share no prefix block), and their outputs."""
    from deterministic_inference.engine.engine import Engine
    from deterministic_inference.engine.sampling_params import SamplingParams

    assert isinstance(engine, Engine)
    engine.flush_prefix_cache()
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    prompts = [f"Request {index}.\n{prompt}" for index in range(streams)]
    start = time.perf_counter()
    outputs = [o.outputs[0] for o in engine.generate(prompts, params)]
    seconds = time.perf_counter() - start
    results = [(o.token_ids, bits(o.logprobs)) for o in outputs]
    return sum(len(o.token_ids) for o in outputs) / seconds, results


def measure(engine: object, prompt: str, streams: int, output_len: int) -> tuple[float, object]:
    """(tokens/s, outputs) of one run: a single request, or `streams` requests together."""
    if streams == 1:
        return one_request(engine, prompt, output_len)
    return many_requests(engine, prompt, streams, output_len)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="GGUF file or HF directory, or 'default'")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--prompts", nargs="+", default=KINDS, choices=KINDS,
                        help="which prompts to run (default: all)")
    parser.add_argument("--streams", type=int, default=1,
                        help="requests run together per measurement (aggregate tokens/s); default 1")
    parser.add_argument("--disable-by-batch-size", type=int, default=None,
                        help="speculative_config.disable_by_batch_size (default: the engine's)")
    parser.add_argument("--llama-python", default=None,
                        help="a Python with llama-cpp-python: adds llama.cpp plain and prompt lookup (K "
                        "tokens) on the same GGUF, single stream")
    args = parser.parse_args()
    if args.llama_python is not None and args.streams != 1:
        parser.error("--llama-python: llama.cpp rows are single stream; drop --streams or --llama-python")
    return args


def llama_workers(python: str, gguf: str, threads: int, k: int) -> tuple[LlamaCppWorker, LlamaCppWorker]:
    """Two llama.cpp processes on `gguf`: plain, and with prompt-lookup decoding of K tokens."""
    workers = (LlamaCppWorker(python), LlamaCppWorker(python))
    for worker, lookup in zip(workers, (0, k), strict=True):
        answer = worker.request(op="load", model=gguf, threads=threads, n_ctx=2048, prompt_lookup=lookup)
    print(f"llama-cpp-python {answer['version']}, prompt lookup num_pred_tokens={k}")
    return workers


def llama_rate(worker: LlamaCppWorker, prompt: str, output_len: int) -> tuple[float, str]:
    """tokens/s (prefill included) and text of one greedy llama.cpp request from an empty cache."""
    answer = worker.request(op="generate", prompt=prompt, max_tokens=output_len)
    return answer["tokens"] / answer["seconds"], answer["text"]


def main() -> None:
    from deterministic_inference.config import EngineConfig
    from deterministic_inference.engine.engine import Engine
    from deterministic_inference.engine.speculative import SpeculativeConfig
    from deterministic_inference.model.default_model import default_model_path
    from deterministic_inference.model.loader import load_model

    args = parse_args()
    model = None if args.model == "default" else args.model
    loaded = load_model(model)
    settings = {"max_num_seqs": max(64, args.streams)}
    plain = Engine(EngineConfig(model=model, **settings), loaded=loaded)
    spec_fields = {"num_speculative_tokens": args.k, "prompt_lookup_max": 4}
    if args.disable_by_batch_size is not None:
        spec_fields["disable_by_batch_size"] = args.disable_by_batch_size
    spec = SpeculativeConfig(method="ngram", **spec_fields)
    speculative = Engine(EngineConfig(model=model, speculative_config=spec, **settings), loaded=loaded)
    gguf = str(default_model_path()) if model is None else model
    print(f"model {gguf}, {args.streams} stream(s), output {args.output_len} tokens, {spec}, "
          f"repeats {args.repeats}")
    llama = "" if args.llama_python is None else f" {'llama tok/s':>11} {'lookup tok/s':>12} {'same text':>9}"
    print(f"{'threads':>7} {'prompt':<28} {'plain tok/s':>11} {'ngram tok/s':>11} {'ratio':>6} "
          f"{'accepted/drafted':>16} {'same bits':>9}{llama}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        workers = None
        if args.llama_python is not None:
            workers = llama_workers(args.llama_python, gguf, threads, args.k)
        try:
            for name in args.prompts:
                prompt = prompt_text(name, loaded.tokenizer)
                row = measure_row(plain, speculative, prompt, args, workers)
                print(f"{threads:>7} {name:<28} {row}")
        finally:
            for worker in workers or ():
                worker.close()


def measure_row(
    plain: object,
    speculative: object,
    prompt: str,
    args: argparse.Namespace,
    workers: tuple[LlamaCppWorker, LlamaCppWorker] | None,
) -> str:
    """One table row: ours plain and ngram (and llama.cpp plain and prompt lookup), alternated
    `repeats` times so all see the same load (ours in the order plain, ngram on even repeats and ngram,
    plain on odd ones); medians, then every run's tokens/s."""
    from deterministic_inference.engine.engine import Engine

    assert isinstance(speculative, Engine)
    before = speculative.stats()["spec_decode"]
    rates: dict[str, list[float]] = {"plain": [], "ngram": [], "llama": [], "lookup": []}
    same, same_text = True, True
    for repeat in range(args.repeats):
        engines = {"plain": plain, "ngram": speculative}
        outputs = {}
        for name in ("plain", "ngram") if repeat % 2 == 0 else ("ngram", "plain"):  # ABAB... BA
            rate, outputs[name] = measure(engines[name], prompt, args.streams, args.output_len)
            rates[name].append(rate)
        same = same and outputs["ngram"] == outputs["plain"]
        if workers is not None:
            rate, text = llama_rate(workers[0], prompt, args.output_len)
            rates["llama"].append(rate)
            rate, lookup_text = llama_rate(workers[1], prompt, args.output_len)
            rates["lookup"].append(rate)
            same_text = same_text and lookup_text == text
    after = speculative.stats()["spec_decode"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    p, s = statistics.median(rates["plain"]), statistics.median(rates["ngram"])
    row = f"{p:>11.1f} {s:>11.1f} {s / p:>5.2f}x {f'{accepted}/{drafted}':>16} {str(same):>9}"
    if workers is not None:
        row += f" {statistics.median(rates['llama']):>11.1f} {statistics.median(rates['lookup']):>12.1f}"
        row += f" {str(same_text):>9}"
    runs = "  ".join(
        f"{name} " + "/".join(f"{r:.0f}" for r in values) for name, values in rates.items() if values
    )
    return f"{row}   runs: {runs}"


if __name__ == "__main__":
    main()
