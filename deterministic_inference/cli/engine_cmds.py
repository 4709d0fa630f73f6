"""`detinf generate`: run prompts through one engine together (batched) and print the outputs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from deterministic_inference.cli.options import add_engine_options, engine_config_from_args
from deterministic_inference.engine.outputs import RequestOutput
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.engine.structured_spec import StructuredOutput
from deterministic_inference.errors import InvalidRequestError
from deterministic_inference.workflow.canonical import canonical_json


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
    constraint = parser.add_mutually_exclusive_group()
    constraint.add_argument(
        "--json-schema", metavar="FILE", default=None,
        help="constrain every output to JSON valid under the JSON schema in FILE (structured output)",
    )
    constraint.add_argument(
        "--regex", metavar="PATTERN", default=None,
        help="constrain every output to match the regular expression PATTERN as a whole",
    )
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    add_engine_options(parser)
    parser.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    """Builds the engine, generates, prints text or JSON (prompt order). The options are checked before
    torch and the engine are imported, so a bad one is reported at once."""
    constraint = structured_output_from_args(args)
    config = engine_config_from_args(args)
    from deterministic_inference.engine.engine import Engine

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        logprobs=args.logprobs,
        structured_output=constraint,
    )
    engine = Engine(config)
    if constraint is not None:
        flag = "--json-schema" if constraint.kind == "json_schema" else "--regex"
        try:
            engine.grammars.compile(constraint)
        except InvalidRequestError as error:
            raise InvalidRequestError(f"{flag}: {error}", param=flag) from None
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


def structured_output_from_args(args: argparse.Namespace) -> StructuredOutput | None:
    """The `--json-schema FILE` / `--regex PATTERN` constraint, or None. A file that cannot be read or is
    not a JSON schema object raises InvalidRequestError naming the flag and the file."""
    if args.regex is not None:
        if not args.regex:
            raise InvalidRequestError("--regex: the pattern is empty; give a regular expression", "--regex")
        return StructuredOutput("regex", args.regex)
    if args.json_schema is None:
        return None
    path, flag = Path(args.json_schema), "--json-schema"
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise InvalidRequestError(f"{flag}: cannot read {path}: {error.strerror}", flag) from None
    except (UnicodeDecodeError, ValueError) as error:
        raise InvalidRequestError(
            f"{flag}: {path} is not valid JSON ({error}); give a JSON schema file", flag
        ) from None
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{flag}: {path} must hold a JSON object (a schema)", flag)
    return StructuredOutput("json_schema", canonical_json(schema))


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
