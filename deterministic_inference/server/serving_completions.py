"""POST /v1/completions: one engine request per prompt; choice index = prompt index * n + choice.

Streaming sends, per choice, the engine's deltas (text and tokens added since the previous chunk), so
the concatenated stream equals the non-streamed response (same text, tokens and logprob bits).
An output constraint (vLLM's `structured_outputs`, `guided_*` or `response_format`) is compiled before
admission; the grammar engine's refusal is a 400 naming the field.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from deterministic_inference.engine.outputs import (
    CompletionDelta,
    CompletionOutput,
    PromptData,
    RequestOutput,
)
from deterministic_inference.model.tokenizer import Tokenizer
from deterministic_inference.server.errors import as_api_error
from deterministic_inference.server.formatting import (
    SSE_DONE,
    completion_logprobs,
    json_response,
    merge_completion_logprobs,
    sse_event,
    text_length,
    usage,
    vllm_prompt_logprobs,
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
from deterministic_inference.server.structured import compile_checked

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def create_completion(ctx: ServingContext, body: CompletionRequest, request: Request) -> Response:
    """Handle /v1/completions (streaming or not)."""
    body.reject_unsupported()
    model = ctx.check_model(body.model)
    info = ctx.info()
    tokenizer = info.tokenizer
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
    spec = await compile_checked(info.grammars, body.constraint())
    params = body.sampling_params(max_tokens, body.logprobs, _prompt_top(body), structured_output=spec)
    prompts = body.prompts()
    ctx.check_capacity(len(prompts), params.n)
    ids = [p if isinstance(p, list) else await ctx.encode(p, "prompt") for p in prompts]
    tracked = await ctx.submit(ids, params, "cmpl")
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
    document["usage"] = usage(outputs)
    return json_response(document)


def _prompt_top(body: CompletionRequest) -> int | None:
    """Top alternatives the engine computes per prompt position: for echo + logprobs and for vLLM's
    prompt_logprobs (the larger; each view slices its own); None when neither asks."""
    wanted = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
    return max(wanted) if wanted else None


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
        self.vllm_prompt_logprobs = body.prompt_logprobs
        self.token_ids = bool(body.return_token_ids)

    def prompt_text(self, index: int) -> str:
        """The echoed prompt: the string given, or the decoded token ids."""
        prompt = self.prompts[index]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt, skip_special_tokens=False)

    def prompt_logprobs(self, prompt: PromptData | RequestOutput) -> dict[str, Any]:
        """Logprobs block of the echoed prompt tokens (first one None)."""
        if isinstance(prompt, PromptData):
            ids, values, tops = prompt.token_ids, prompt.logprobs, prompt.top_logprobs
        else:
            ids, values, tops = prompt.prompt_token_ids, prompt.prompt_logprobs, prompt.prompt_top_logprobs
        if tops is not None and self.logprobs is not None:
            tops = [list(step[: self.logprobs]) for step in tops]
        return completion_logprobs(self.tokenizer, ids, list(values or [None] * len(ids)), tops, 0)

    def prompt_extras(self, prompt: PromptData | RequestOutput) -> dict[str, Any]:
        """vLLM's per-choice prompt fields: `prompt_logprobs` and (return_token_ids) `prompt_token_ids`."""
        if isinstance(prompt, PromptData):
            ids, values, tops = prompt.token_ids, prompt.logprobs, prompt.top_logprobs
        else:
            ids, values, tops = prompt.prompt_token_ids, prompt.prompt_logprobs, prompt.prompt_top_logprobs
        extras: dict[str, Any] = {}
        if self.vllm_prompt_logprobs is not None:
            extras["prompt_logprobs"] = vllm_prompt_logprobs(
                self.tokenizer, ids, values or [None] * len(ids), tops, self.vllm_prompt_logprobs
            )
        if self.token_ids:
            extras["prompt_token_ids"] = list(ids)
        return extras

    def tokens_logprobs(self, choice: CompletionOutput | CompletionDelta, text_offset: int) -> dict[str, Any]:
        """Logprobs block of a choice's (or a delta's) generated tokens."""
        return completion_logprobs(
            self.tokenizer, choice.token_ids, choice.logprobs, choice.top_logprobs, text_offset
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
                    [self.prompt_logprobs(output), self.tokens_logprobs(choice, offset)]
                )
        elif self.logprobs is not None:
            logprobs = self.tokens_logprobs(choice, 0)
        document = {
            "index": index * self.n + choice.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
            **self.prompt_extras(output),
        }
        if self.token_ids:
            document["token_ids"] = list(choice.token_ids)
        return document


class _ChoiceProgress:
    """What a streamed choice has sent so far."""

    def __init__(self) -> None:
        self.text_offset = 0  # characters of the choice's text sent (echoed prompt included)
        self.started = False
        self.finished = False


async def _stream(
    fingerprint: str, tracked: list[Tracked], view: _CompletionView, response_id: str, model: str
) -> AsyncIterator[str]:
    include_usage = view.include_usage
    progress: dict[tuple[int, int], _ChoiceProgress] = {}
    try:
        async for index, delta in merged(tracked):
            assembler = tracked[index].so_far()
            for piece in delta.outputs:
                state = progress.setdefault((index, piece.index), _ChoiceProgress())
                choice = _piece(view, index, assembler.prompt, piece, state)
                if choice is not None:
                    chunk = response_meta(fingerprint, "text_completion", response_id, model)
                    chunk["choices"] = [choice]
                    if include_usage:
                        chunk["usage"] = None
                    yield sse_event(chunk)
        if include_usage:
            final = response_meta(fingerprint, "text_completion", response_id, model)
            final["choices"] = []
            final["usage"] = usage([item.final for item in tracked if item.final is not None])
            yield sse_event(final)
    except Exception as error:  # the stream has started: report in-band
        yield sse_event(as_api_error(error).body())
    finally:
        close_all(tracked)
    yield SSE_DONE


def _piece(
    view: _CompletionView, index: int, prompt: PromptData, piece: CompletionDelta, state: _ChoiceProgress
) -> dict[str, Any] | None:
    """The chunk choice for one delta of one choice, or None if it holds nothing to send."""
    if state.finished:
        return None
    parts: list[dict[str, Any]] = []
    text = ""
    extras = {} if state.started else view.prompt_extras(prompt)  # vLLM: prompt fields in the first chunk
    if not state.started and view.echo:
        text = view.prompt_text(index)
        state.text_offset = len(text)
        if view.logprobs is not None:
            parts.append(view.prompt_logprobs(prompt))
    if not piece.text and not piece.token_ids and not text and piece.finish_reason is None:
        return None
    state.started = True
    if view.logprobs is not None and piece.token_ids:
        parts.append(view.tokens_logprobs(piece, state.text_offset))
    text += piece.text
    state.text_offset += sum(text_length(view.tokenizer, t) for t in piece.token_ids)
    state.finished = piece.finish_reason is not None
    chunk = {
        "index": index * view.n + piece.index,
        "text": text,
        "logprobs": merge_completion_logprobs(parts) if parts else None,
        "finish_reason": piece.finish_reason,
        "stop_reason": piece.stop_reason if state.finished else None,
        **extras,
    }
    if view.token_ids:
        chunk["token_ids"] = list(piece.token_ids)
    return chunk
