"""SGLang's native POST /generate, for users and scripts migrating from SGLang.

One prompt (text or input_ids) with n == 1 answers one object; a batch or n > 1 answers a list (prompt
major, choice minor). Streaming sends, for each choice the engine's delta changed, the choice's
cumulative object (SGLang's format, built from the deltas folded so far), then `data: [DONE]`.

Logprobs (``return_logprob``) use SGLang's shapes in ``meta_info``: ``input_token_logprobs`` and
``output_token_logprobs`` are lists of ``[logprob, token_id, text]`` (text only with
``return_text_in_logprobs``, else null); ``input_token_logprobs`` covers the prompt from
``logprob_start_len`` (default -1: none) and its first entry's logprob is null, as in SGLang. With
``top_logprobs_num`` > 0, ``input_top_logprobs`` / ``output_top_logprobs`` hold one list of such entries
per position (null for the first input position). Values are the engine's float32 logprobs written in
full precision (the shortest decimal that reads back as the same float), so a client comparing them with
``==`` compares bits: a decoded token's logprob equals the same token's prompt logprob when the sequence
is sent back as a prompt (the engine's decode == prefill identity).

`sampling_params` `json_schema` (JSON text), `regex`, `ebnf` and `structural_tag` constrain a prompt's
output (at most one each); they are compiled before admission, and a refusal is a 400 naming the field.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from deterministic_inference.engine.outputs import CompletionOutput, TopLogprobs
from deterministic_inference.model.tokenizer import Tokenizer
from deterministic_inference.server.errors import as_api_error
from deterministic_inference.server.formatting import SSE_DONE, finite, json_response, sse_event
from deterministic_inference.server.protocol_generate import GenerateRequest, PromptOptions
from deterministic_inference.server.serving import (
    ServingContext,
    Tracked,
    close_all,
    merged,
    results,
    unless_disconnected,
)
from deterministic_inference.server.serving_completions import SSE_HEADERS
from deterministic_inference.server.structured import compile_checked


async def generate(ctx: ServingContext, body: GenerateRequest, request: Request) -> Response:
    """Handle /generate."""
    prompts, batched = body.prompts()
    options = body.prompt_options(len(prompts))
    info = ctx.info()
    param = "text" if body.text is not None else "input_ids"
    ctx.check_capacity(len(prompts), 1, param)  # before tokenizing; `submit` checks every prompt's n
    specs = [await compile_checked(info.grammars, o.sampling.constraint()) for o in options]
    ids = [p if isinstance(p, list) else await ctx.encode(p, param) for p in prompts]
    params = [
        o.params(len(prompt), param, spec) for o, prompt, spec in zip(options, ids, specs, strict=True)
    ]
    tracked = await ctx.submit(ids, params, "gen", param, "sampling_params.max_new_tokens")
    view = _View(info.tokenizer, info.system_fingerprint, options, [p.n for p in params])
    single = not batched and params[0].n == 1
    if body.stream:
        return StreamingResponse(_stream(tracked, view), media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        outputs = await unless_disconnected(request, results(tracked))
    finally:
        close_all(tracked)
    items = [
        view.item(i, o.request_id, o.prompt_token_ids, o.prompt_logprobs, o.prompt_top_logprobs,
                  o.num_cached_tokens, choice)
        for i, o in enumerate(outputs)
        for choice in o.outputs
    ]
    return json_response(items[0] if single else items)


class _View:
    """Formats the response items of one /generate request."""

    def __init__(
        self, tokenizer: Tokenizer, fingerprint: str, options: Sequence[PromptOptions], counts: Sequence[int]
    ) -> None:
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.options = options
        self.offsets = [sum(counts[:i]) for i in range(len(counts))]  # index of each prompt's choice 0

    def item(
        self,
        prompt_index: int,
        request_id: str,
        prompt_ids: list[int],
        prompt_logprobs: list[float | None] | None,
        prompt_tops: list[TopLogprobs] | None,
        cached_tokens: int,
        choice: CompletionOutput,
    ) -> dict[str, Any]:
        """One response object (SGLang's `text`, `output_ids`, `meta_info`), cumulative when streamed."""
        meta: dict[str, Any] = {
            "id": f"{request_id}-{choice.index}",
            "finish_reason": _finish_reason(choice),
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(choice.token_ids),
            "cached_tokens": cached_tokens,
            "system_fingerprint": self.fingerprint,
        }
        options = self.options[prompt_index]
        if options.return_logprob:
            meta.update(self.logprobs(options, prompt_ids, prompt_logprobs, prompt_tops, choice))
        return {
            "text": choice.text,
            "output_ids": list(choice.token_ids),
            "index": self.offsets[prompt_index] + choice.index,
            "meta_info": meta,
        }

    def logprobs(
        self,
        options: PromptOptions,
        prompt_ids: list[int],
        prompt_logprobs: list[float | None] | None,
        prompt_tops: list[TopLogprobs] | None,
        choice: CompletionOutput,
    ) -> dict[str, Any]:
        """The logprob fields of meta_info, in SGLang's shapes (see the module docstring)."""
        start = options.input_start(len(prompt_ids))
        positions = range(start, len(prompt_ids))
        values = prompt_logprobs or [None] * len(prompt_ids)
        fields: dict[str, Any] = {
            "input_token_logprobs": [
                self.entry(None if k == start else values[k], prompt_ids[k], options) for k in positions
            ],
            "output_token_logprobs": [
                self.entry(lp, token, options)
                for token, lp in zip(choice.token_ids, choice.logprobs, strict=True)
            ],
        }
        fields["output_token_logprobs_length"] = len(fields["output_token_logprobs"])
        if options.top_logprobs_num > 0:
            tops = prompt_tops or [[] for _ in prompt_ids]
            fields["input_top_logprobs"] = [
                None if k == start else self.tops(tops[k], options) for k in positions
            ]
            fields["output_top_logprobs"] = [self.tops(step, options) for step in choice.top_logprobs]
        return fields

    def entry(self, logprob: float | None, token: int, options: PromptOptions) -> list[Any]:
        """`[logprob, token_id, text or null]` (logprob in full precision; null for no value)."""
        text = None
        if options.return_text_in_logprobs:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
        return [None if logprob is None else finite(logprob), token, text]

    def tops(self, step: TopLogprobs, options: PromptOptions) -> list[list[Any]]:
        """One position's top alternatives as entries (best first)."""
        return [self.entry(lp, token, options) for token, lp in step]


def _finish_reason(choice: CompletionOutput) -> dict[str, Any] | None:
    if choice.finish_reason is None:
        return None
    if choice.finish_reason == "length":
        return {"type": "length", "length": len(choice.token_ids)}
    return {"type": choice.finish_reason, "matched": choice.stop_reason}


async def _stream(tracked: list[Tracked], view: _View) -> AsyncIterator[str]:
    try:
        async for index, delta in merged(tracked):
            assembler = tracked[index].assembler
            assert assembler is not None  # set from the first delta
            prompt = assembler.prompt
            for piece in delta.outputs:
                choice = assembler.choices[piece.index]  # cumulative (SGLang streams whole objects)
                yield sse_event(
                    view.item(index, delta.request_id, prompt.token_ids, prompt.logprobs, prompt.top_logprobs,
                              assembler.num_cached_tokens, choice)
                )
    except Exception as error:  # the stream has started: report in-band
        yield sse_event(as_api_error(error).body())
    finally:
        close_all(tracked)
    yield SSE_DONE
