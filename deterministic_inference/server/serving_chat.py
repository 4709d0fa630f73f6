"""POST /v1/chat/completions: messages rendered with the model's chat template, then generated.

The template is rendered and encoded before admission (on the event loop, or in a worker thread for
long conversations; the tokenizer is read-only); the token ids go to the engine, so a chat request
equals a completions request with the same ids. Streaming sends the engine's deltas.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from deterministic_inference.engine.outputs import CompletionDelta, CompletionOutput, RequestOutput
from deterministic_inference.errors import InvalidRequestError
from deterministic_inference.model.tokenizer import Tokenizer
from deterministic_inference.server.errors import as_api_error
from deterministic_inference.server.formatting import (
    SSE_DONE,
    chat_logprobs_content,
    json_response,
    sse_event,
    usage,
)
from deterministic_inference.server.protocol import ChatCompletionRequest
from deterministic_inference.server.serving import (
    ServingContext,
    Tracked,
    response_meta,
    unless_disconnected,
)
from deterministic_inference.server.serving_completions import SSE_HEADERS


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, request: Request
) -> Response:
    """Handle /v1/chat/completions (streaming or not)."""
    body.reject_unsupported()
    model = ctx.check_model(body.model)
    info = ctx.info()
    prompt_ids = await ctx.render_chat(body.template_messages())
    max_tokens = body.max_new_tokens()
    if max_tokens is None:
        max_tokens = info.max_model_len - len(prompt_ids)
        if max_tokens < 1:
            raise InvalidRequestError(
                f"messages: the prompt has {len(prompt_ids)} tokens, the context holds {info.max_model_len}",
                param="messages",
            )
    num_top = body.num_top_logprobs()
    params = body.sampling_params(max_tokens, num_top)
    tracked = (await ctx.submit([prompt_ids], params, "chatcmpl", prompt_param="messages"))[0]
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    view = _ChatView(info.tokenizer, num_top)
    if body.stream:
        generator = _stream(info.system_fingerprint, tracked, view, response_id, model, body.include_usage)
        return StreamingResponse(generator, media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        output = await unless_disconnected(request, tracked.result())
    finally:
        tracked.close()
    document = response_meta(info.system_fingerprint, "chat.completion", response_id, model)
    document["choices"] = [view.choice(choice) for choice in output.outputs]
    document["usage"] = _usage(output)
    return json_response(document)


class _ChatView:
    """Turns engine outputs into chat choices (message, logprobs)."""

    def __init__(self, tokenizer: Tokenizer, num_top: int | None) -> None:
        self.tokenizer = tokenizer
        self.num_top = num_top  # None = no logprobs asked

    def logprobs(self, choice: CompletionOutput | CompletionDelta) -> dict[str, Any] | None:
        """`logprobs` of a choice's (or a delta's) tokens, or None when not asked for."""
        if self.num_top is None:
            return None
        content = chat_logprobs_content(
            self.tokenizer, choice.token_ids, choice.logprobs, choice.top_logprobs, self.num_top
        )
        return {"content": content, "refusal": None}

    def choice(self, choice: CompletionOutput) -> dict[str, Any]:
        """A full (non-streamed) choice."""
        return {
            "index": choice.index,
            "message": {"role": "assistant", "content": choice.text, "refusal": None},
            "logprobs": self.logprobs(choice),
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }


def _usage(output: RequestOutput) -> dict[str, Any]:
    generated = sum(len(c.token_ids) for c in output.outputs)
    return usage(len(output.prompt_token_ids), generated, output.num_cached_tokens)


async def _stream(
    fingerprint: str,
    tracked: Tracked,
    view: _ChatView,
    response_id: str,
    model: str,
    include_usage: bool,
) -> AsyncIterator[str]:
    started: set[int] = set()
    done: set[int] = set()

    def chunk(choices: list[dict[str, Any]]) -> str:
        document = response_meta(fingerprint, "chat.completion.chunk", response_id, model)
        document["choices"] = choices
        if include_usage:
            document["usage"] = None
        return sse_event(document)

    try:
        async for delta in tracked.deltas():
            for piece in delta.outputs:
                if piece.index in done:
                    continue
                if piece.index not in started:
                    started.add(piece.index)
                    role = {"role": "assistant", "content": ""}
                    yield chunk(
                        [{"index": piece.index, "delta": role, "logprobs": None, "finish_reason": None}]
                    )
                if piece.text or piece.token_ids:
                    content = {
                        "index": piece.index,
                        "delta": {"content": piece.text},
                        "logprobs": view.logprobs(piece),
                        "finish_reason": None,
                    }
                    yield chunk([content])
                if piece.finish_reason is not None:
                    done.add(piece.index)
                    finish = {
                        "index": piece.index,
                        "delta": {},
                        "logprobs": None,
                        "finish_reason": piece.finish_reason,
                        "stop_reason": piece.stop_reason,
                    }
                    yield chunk([finish])
        if include_usage and tracked.final is not None:
            final = response_meta(fingerprint, "chat.completion.chunk", response_id, model)
            final["choices"] = []
            final["usage"] = _usage(tracked.final)
            yield sse_event(final)
    except Exception as error:  # the stream has started: report in-band
        yield sse_event(as_api_error(error).body())
    finally:
        tracked.close()
    yield SSE_DONE
