"""POST /v1/chat/completions: messages rendered with the model's chat template, then generated.

The template is rendered and encoded on the event loop (the tokenizer is read-only and fast); the
token ids go to the engine, so a chat request equals a completions request with the same ids.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from deterministic_inference.engine.outputs import CompletionOutput, RequestOutput
from deterministic_inference.errors import InvalidRequestError
from deterministic_inference.model.tokenizer import Tokenizer
from deterministic_inference.server.errors import as_api_error, parse_body
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


async def create_chat_completion(ctx: ServingContext, request: Request) -> Response:
    """Handle /v1/chat/completions (streaming or not)."""
    body = await parse_body(request, ChatCompletionRequest)
    body.reject_unsupported()
    model = ctx.check_model(body.model)
    info = ctx.info()
    prompt_ids = info.tokenizer.encode(info.tokenizer.apply_chat_template(body.template_messages()))
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
    tracked = (await ctx.submit([prompt_ids], params, "chatcmpl"))[0]
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

    def logprobs(self, choice: CompletionOutput, start: int, end: int) -> dict[str, Any] | None:
        """`logprobs` of tokens [start, end), or None when not asked for."""
        if self.num_top is None:
            return None
        content = chat_logprobs_content(
            self.tokenizer,
            choice.token_ids[start:end],
            choice.logprobs[start:end],
            choice.top_logprobs[start:end],
            self.num_top,
        )
        return {"content": content, "refusal": None}

    def choice(self, choice: CompletionOutput) -> dict[str, Any]:
        """A full (non-streamed) choice."""
        return {
            "index": choice.index,
            "message": {"role": "assistant", "content": choice.text, "refusal": None},
            "logprobs": self.logprobs(choice, 0, len(choice.token_ids)),
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
    sent: dict[int, tuple[int, int]] = {}  # choice index -> (text length, tokens) sent
    done: set[int] = set()

    def chunk(choices: list[dict[str, Any]]) -> str:
        document = response_meta(fingerprint, "chat.completion.chunk", response_id, model)
        document["choices"] = choices
        if include_usage:
            document["usage"] = None
        return sse_event(document)

    try:
        async for output in tracked.outputs():
            for choice in output.outputs:
                if choice.index in done:
                    continue
                if choice.index not in sent:
                    sent[choice.index] = (0, 0)
                    role = {"role": "assistant", "content": ""}
                    yield chunk(
                        [{"index": choice.index, "delta": role, "logprobs": None, "finish_reason": None}]
                    )
                text_length, tokens = sent[choice.index]
                if len(choice.text) > text_length or len(choice.token_ids) > tokens:
                    delta = {"content": choice.text[text_length:]}
                    logprobs = view.logprobs(choice, tokens, len(choice.token_ids))
                    yield chunk(
                        [{"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}]
                    )
                    sent[choice.index] = (len(choice.text), len(choice.token_ids))
                if choice.finish_reason is not None:
                    done.add(choice.index)
                    finish = {
                        "index": choice.index,
                        "delta": {},
                        "logprobs": None,
                        "finish_reason": choice.finish_reason,
                        "stop_reason": choice.stop_reason,
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
