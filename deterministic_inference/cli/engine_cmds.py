"""`detinf generate`: run prompts through one engine together (batched) and print the outputs."""

from __future__ import annotations

import argparse
import json
from typing import Any

from deterministic_inference.cli.options import add_engine_options, engine_config_from_args
from deterministic_inference.engine.outputs import RequestOutput
from deterministic_inference.engine.sampling_params import SamplingParams


def register(subparsers: Any) -> None:
    """Adds `generate`."""
    parser = subparsers.add_parser("generate", help="generate completions for prompts (batched)")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for several")
    parser.add_argument(
        "--max-tokens", type=int, default=16, help="tokens to generate per prompt (default 16)"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default 0)"
    )
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens whose "
        "probability reaches this (default 1.0 = off)"
    )
    parser.add_argument(
        "--top-k", type=int, default=0, help="keep only the k most likely tokens (default 0 = off)"
    )
    parser.add_argument(
        "--seed", type=int, default=None,
        help="sampling seed; the same seed gives the same tokens (default: the engine's --default-seed)",
    )
    parser.add_argument(
        "--logprobs", type=int, default=None,
        help="also return this many top alternatives (with logprobs) per generated token",
    )
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    add_engine_options(parser)
    parser.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    """Builds the engine, generates, prints text or JSON (prompt order)."""
    from deterministic_inference.engine.engine import Engine

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        logprobs=args.logprobs,
    )
    engine = Engine(engine_config_from_args(args))
    prompts = args.prompt
    if args.chat:
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    outputs = engine.generate(prompts, params)
    if args.json:
        print(json.dumps(generate_json(engine.system_fingerprint, outputs), ensure_ascii=False))
    else:
        for output in outputs:
            print(output.outputs[0].text)
    return 0


def generate_json(system_fingerprint: str, outputs: list[RequestOutput]) -> dict[str, Any]:
    """The `--json` document: fingerprint and one entry per prompt (choice 0)."""
    entries = []
    for output in outputs:
        choice = output.outputs[0]
        entries.append(
            {
                "prompt_token_ids": output.prompt_token_ids,
                "output_token_ids": choice.token_ids,
                "logprobs": choice.logprobs,
                "top_logprobs": [[[token, value] for token, value in step] for step in choice.top_logprobs],
                "text": choice.text,
                "finish_reason": choice.finish_reason,
            }
        )
    return {"system_fingerprint": system_fingerprint, "outputs": entries}
