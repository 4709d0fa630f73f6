"""POST /v1/completions: one engine request per prompt; choice index = prompt index * n + choice.

Streaming sends, per choice, the text and tokens added since the previous chunk, so the concatenated
stream equals the non-streamed response (same text, tokens and logprob bits).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from deterministic_inference.engine.outputs import CompletionOutput, RequestOutput
from deterministic_inference.model.tokenizer import Tokenizer
from deterministic_inference.server.errors import as_api_error, parse_body
from deterministic_inference.server.formatting import (
    SSE_DONE,
    completion_logprobs,
    json_response,
    merge_completion_logprobs,
    sse_event,
    text_length,
    usage,
)
from deterministic_inference.server.protocol import DEFAULT_COMPLETION_MAX_TOKENS, CompletionRequest
from deterministic_inference.server.serving import (
    ServingContext,
    Tracked,
    close_all,
    merged,
    response_meta,
    results,
    unless_disconnected,
)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def create_completion(ctx: ServingContext, request: Request) -> Response:
    """Handle /v1/completions (streaming or not)."""
    body = await parse_body(request, CompletionRequest)
    body.reject_unsupported()
    model = ctx.check_model(body.model)
    info = ctx.info()
    tokenizer = info.tokenizer
    echo = bool(body.echo)
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
    prompt_logprobs = body.logprobs if echo and body.logprobs is not None else None
    params = body.sampling_params(max_tokens, body.logprobs, prompt_logprobs)
    prompts = body.prompts()
    tracked = await ctx.submit(prompts, params, "cmpl")
    response_id = f"cmpl-{uuid.uuid4().hex}"
    view = _CompletionView(tokenizer, body, prompts, params.n)
    if body.stream:
        return StreamingResponse(
            _stream(info.system_fingerprint, tracked, view, response_id, model),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    try:
        outputs = await unless_disconnected(request, results(tracked))
    finally:
        close_all(tracked)
    choices = [
        view.choice(i, output, choice) for i, output in enumerate(outputs) for choice in output.outputs
    ]
    document = response_meta(info.system_fingerprint, "text_completion", response_id, model)
    document["choices"] = choices
    document["usage"] = _usage(outputs)
    return json_response(document)


class _CompletionView:
    """Turns engine outputs into completion choices (echo, logprobs)."""

    def __init__(
        self, tokenizer: Tokenizer, body: CompletionRequest, prompts: list[str | list[int]], n: int
    ) -> None:
        self.tokenizer = tokenizer
        self.echo = bool(body.echo)
        self.logprobs = body.logprobs
        self.prompts = prompts
        self.n = n
        self.include_usage = body.include_usage

    def prompt_text(self, index: int) -> str:
        """The echoed prompt: the string given, or the decoded token ids."""
        prompt = self.prompts[index]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt, skip_special_tokens=False)

    def prompt_logprobs(self, index: int, output: RequestOutput) -> dict[str, Any]:
        """Logprobs block of the echoed prompt tokens (first one None)."""
        return completion_logprobs(
            self.tokenizer,
            output.prompt_token_ids,
            list(output.prompt_logprobs or [None] * len(output.prompt_token_ids)),
            output.prompt_top_logprobs,
            0,
        )

    def tokens_logprobs(
        self, choice: CompletionOutput, start: int, end: int, text_offset: int
    ) -> dict[str, Any]:
        """Logprobs block of generated tokens [start, end)."""
        return completion_logprobs(
            self.tokenizer,
            choice.token_ids[start:end],
            choice.logprobs[start:end],
            choice.top_logprobs[start:end],
            text_offset,
        )

    def choice(self, index: int, output: RequestOutput, choice: CompletionOutput) -> dict[str, Any]:
        """A full (non-streamed) choice."""
        text = choice.text
        logprobs = None
        if self.echo:
            prompt_text = self.prompt_text(index)
            text = prompt_text + text
            if self.logprobs is not None:
                offset = len(prompt_text)
                logprobs = merge_completion_logprobs(
                    [
                        self.prompt_logprobs(index, output),
                        self.tokens_logprobs(choice, 0, len(choice.token_ids), offset),
                    ]
                )
        elif self.logprobs is not None:
            logprobs = self.tokens_logprobs(choice, 0, len(choice.token_ids), 0)
        return {
            "index": index * self.n + choice.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }


def _usage(outputs: list[RequestOutput]) -> dict[str, Any]:
    return usage(
        sum(len(o.prompt_token_ids) for o in outputs),
        sum(len(c.token_ids) for o in outputs for c in o.outputs),
        sum(o.num_cached_tokens for o in outputs),
    )


class _ChoiceProgress:
    """What a streamed choice has sent so far."""

    def __init__(self) -> None:
        self.text_length = 0
        self.tokens = 0
        self.text_offset = 0
        self.started = False
        self.finished = False


async def _stream(
    fingerprint: str, tracked: list[Tracked], view: _CompletionView, response_id: str, model: str
) -> AsyncIterator[str]:
    include_usage = view.include_usage
    progress: dict[tuple[int, int], _ChoiceProgress] = {}
    try:
        async for index, output in merged(tracked):
            for choice in output.outputs:
                state = progress.setdefault((index, choice.index), _ChoiceProgress())
                piece = _delta(view, index, output, choice, state)
                if piece is not None:
                    chunk = response_meta(fingerprint, "text_completion", response_id, model)
                    chunk["choices"] = [piece]
                    if include_usage:
                        chunk["usage"] = None
                    yield sse_event(chunk)
        if include_usage:
            final = response_meta(fingerprint, "text_completion", response_id, model)
            final["choices"] = []
            final["usage"] = _usage([item.final for item in tracked if item.final is not None])
            yield sse_event(final)
    except Exception as error:  # the stream has started: report in-band
        yield sse_event(as_api_error(error).body())
    finally:
        close_all(tracked)
    yield SSE_DONE


def _delta(
    view: _CompletionView, index: int, output: RequestOutput, choice: CompletionOutput, state: _ChoiceProgress
) -> dict[str, Any] | None:
    """The chunk choice for what is new in `choice`, or None if nothing is."""
    if state.finished:
        return None
    parts: list[dict[str, Any]] = []
    text = ""
    if not state.started and view.echo:
        text = view.prompt_text(index)
        state.text_offset = len(text)
        if view.logprobs is not None:
            parts.append(view.prompt_logprobs(index, output))
    new_text = choice.text[state.text_length :]
    new_tokens = len(choice.token_ids) - state.tokens
    if not new_text and not new_tokens and not text and choice.finish_reason is None:
        return None
    state.started = True
    if view.logprobs is not None and new_tokens:
        parts.append(view.tokens_logprobs(choice, state.tokens, len(choice.token_ids), state.text_offset))
    text += new_text
    state.text_offset += sum(text_length(view.tokenizer, t) for t in choice.token_ids[state.tokens :])
    state.text_length = len(choice.text)
    state.tokens = len(choice.token_ids)
    state.finished = choice.finish_reason is not None
    return {
        "index": index * view.n + choice.index,
        "text": text,
        "logprobs": merge_completion_logprobs(parts) if parts else None,
        "finish_reason": choice.finish_reason,
        "stop_reason": choice.stop_reason if state.finished else None,
    }
