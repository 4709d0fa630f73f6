"""Single-stream speculative decoding (ngram prompt lookup) vs plain decoding, on copy-heavy prompts and
on free text, threads 1 and 2, in one run.

Run by hand from the repository root:
    .venv/bin/python -m bench.bench_spec [--model default] [--threads 1 2] [--output-len 96] [--repeats 3] \
        [--prompts "copy: repeat a passage" "free text"]

Two engines on the same loaded model, one plain and one with
`{"method": "ngram", "num_speculative_tokens": K}`; each request greedy (end-of-sequence ignored) from an
empty prefix cache. Plain and speculative runs alternate, so both see the same load on a shared machine;
the ratio of the medians (tokens / wall time of the request, prefill included) is the figure to read.
Every speculative output is checked to be bitwise the plain one (token ids and logprob bits) and the
acceptance counters are printed. llama.cpp's prompt lookup is not run by this script.
"""

from __future__ import annotations

import argparse
import statistics
import struct
import time

import torch

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
PROMPTS = {
    "copy: quote-and-summarise": f"{PASSAGE}\n\nQuote the passage above word for word, then summarise it.\n"
    "Quote: The lighthouse stood",
    "copy: code edit": f"{CODE}\nRewrite the function above with the variable `chunk` renamed to `part`. "
    "Keep everything else the same.\n\n```python\ndef moving_average(values, window):",
    "copy: repeat a passage": f"{PASSAGE}\n\nRepeat the passage above exactly.\n\n{PASSAGE[:60]}",
    "free text": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


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


def main() -> None:
    from deterministic_inference.config import EngineConfig
    from deterministic_inference.engine.engine import Engine
    from deterministic_inference.engine.speculative import SpeculativeConfig
    from deterministic_inference.model.loader import load_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="GGUF file or HF directory, or 'default'")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--prompts", nargs="+", default=list(PROMPTS), choices=list(PROMPTS),
                        help="which prompts to run (default: all)")
    args = parser.parse_args()
    model = None if args.model == "default" else args.model
    loaded = load_model(model)
    plain = Engine(EngineConfig(model=model), loaded=loaded)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=args.k, prompt_lookup_max=4)
    speculative = Engine(EngineConfig(model=model, speculative_config=spec), loaded=loaded)
    print(f"model {args.model}, output {args.output_len} tokens, K={args.k}, repeats {args.repeats}")
    print(f"{'threads':>7} {'prompt':<28} {'plain tok/s':>11} {'ngram tok/s':>11} {'ratio':>6} "
          f"{'accepted/drafted':>16} {'same bits':>9}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name in args.prompts:
            prompt = PROMPTS[name]
            before = speculative.stats()["spec_decode"]
            plain_rates, spec_rates, same = [], [], True
            for _ in range(args.repeats):  # alternate: both see the same load
                rate, reference = one_request(plain, prompt, args.output_len)
                plain_rates.append(rate)
                rate, result = one_request(speculative, prompt, args.output_len)
                spec_rates.append(rate)
                same = same and result == reference
            after = speculative.stats()["spec_decode"]
            accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
            drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
            p, s = statistics.median(plain_rates), statistics.median(spec_rates)
            print(f"{threads:>7} {name:<28} {p:>11.1f} {s:>11.1f} {s / p:>5.2f}x "
                  f"{f'{accepted}/{drafted}':>16} {str(same):>9}")


if __name__ == "__main__":
    main()
