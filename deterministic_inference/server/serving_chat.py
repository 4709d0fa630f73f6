"""POST /v1/chat/completions: messages rendered with the model's chat template, then generated.

The template is rendered and encoded before admission (on the event loop, or in a worker thread for
long conversations; the tokenizer is read-only); the token ids go to the engine, so a chat request
equals a completions request with the same ids. Streaming sends the engine's deltas.

Output constraints (`response_format`, the tool-call grammar, vLLM's fields) are compiled before
admission (a 400 naming the field when the grammar engine refuses them). With tools (and tool_choice
other than "none") the answer's text is parsed into `message.tool_calls` (see `tool_parser`): streamed,
the first delta of a call carries its index, id, type, name and empty arguments, then argument
fragments follow; `finish_reason` is "tool_calls" when the answer holds calls and stopped on its own.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from deterministic_inference.engine.outputs import CompletionDelta, CompletionOutput
from deterministic_inference.errors import InvalidRequestError
from deterministic_inference.model.tokenizer import Tokenizer
from deterministic_inference.server.chat_history import template_input
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
from deterministic_inference.server.structured import compile_checked
from deterministic_inference.server.tool_llama import parse_llama_calls
from deterministic_inference.server.tool_parser import (
    Parsed,
    ToolCallStream,
    message_fields,
    new_call_id,
    parse_calls,
)
from deterministic_inference.server.tools import ToolPlan, tool_style


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, request: Request
) -> Response:
    """Handle /v1/chat/completions (streaming or not)."""
    body.reject_unsupported()
    model = ctx.check_model(body.model)
    info = ctx.info()
    plan = body.tool_plan(tool_style(info.tokenizer.chat_template))
    spec = await compile_checked(info.grammars, body.constraint(plan))
    messages, tools = template_input(body.template_messages(), plan, info.tokenizer.chat_template)
    prompt_ids = await ctx.render_chat(messages, tools)
    max_tokens = body.max_new_tokens()
    if max_tokens is None:
        max_tokens = info.max_model_len - len(prompt_ids)
        if max_tokens < 1:
            raise InvalidRequestError(
                f"messages: the prompt has {len(prompt_ids)} tokens, the context holds {info.max_model_len}",
                param="messages",
            )
    num_top = body.num_top_logprobs()
    params = body.sampling_params(max_tokens, num_top, structured_output=spec)
    tracked = (await ctx.submit([prompt_ids], params, "chatcmpl", prompt_param="messages"))[0]
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    view = _ChatView(info.tokenizer, num_top, plan)
    if body.stream:
        generator = _stream(info.system_fingerprint, tracked, view, response_id, model, body.include_usage)
        return StreamingResponse(generator, media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        output = await unless_disconnected(request, tracked.result())
    finally:
        tracked.close()
    document = response_meta(info.system_fingerprint, "chat.completion", response_id, model)
    document["choices"] = [view.choice(choice) for choice in output.outputs]
    document["usage"] = usage([output])
    return json_response(document)


class _ChatView:
    """Turns engine outputs into chat choices (message, logprobs)."""

    def __init__(self, tokenizer: Tokenizer, num_top: int | None, plan: ToolPlan) -> None:
        self.tokenizer = tokenizer
        self.num_top = num_top  # None = no logprobs asked
        self.parses_calls = plan.parses_calls
        self.max_calls = None if plan.parallel else 1  # later blocks stay text without parallel calls
        self.parse = parse_llama_calls if plan.style == "llama3_json" else parse_calls

    def tool_stream(self) -> ToolCallStream | None:
        """A streamed choice's tool-call state (None when the answer is not parsed for calls)."""
        return ToolCallStream(self.max_calls, self.parse) if self.parses_calls else None

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
        message: dict[str, Any] = {"role": "assistant", "content": choice.text, "refusal": None}
        finish_reason = choice.finish_reason
        if self.parses_calls:
            parsed = self.parse(choice.text, True, self.max_calls)
            fields = message_fields(parsed, [new_call_id() for _ in parsed.calls])
            message["content"] = fields["content"]
            if fields["tool_calls"]:
                message["tool_calls"] = fields["tool_calls"]
            finish_reason = tool_finish_reason(parsed, finish_reason)
        return {
            "index": choice.index,
            "message": message,
            "logprobs": self.logprobs(choice),
            "finish_reason": finish_reason,
            "stop_reason": choice.stop_reason,
        }


def tool_finish_reason(parsed: Parsed, finish_reason: str | None) -> str | None:
    """"tool_calls" when the answer holds calls and ended on its own ("stop"), else the engine's reason."""
    return "tool_calls" if parsed.calls and finish_reason == "stop" else finish_reason


def _piece_chunks(
    view: _ChatView, piece: CompletionDelta, tool_stream: ToolCallStream | None
) -> list[dict[str, Any]]:
    """The chunk choices of one delta: its text as content, or (parsing tool calls) the content and
    call deltas the text so far decides; the piece's logprobs ride on the first of them (on an empty
    delta when the parser holds all of its text back)."""
    final = piece.finish_reason is not None
    if tool_stream is None:
        deltas = [{"content": piece.text}] if piece.text or piece.token_ids else []
    else:
        deltas = tool_stream.advance(piece.text, final)
        if not deltas and piece.token_ids and view.num_top is not None:
            deltas = [{}]
    return [
        {"index": piece.index, "delta": delta, "logprobs": view.logprobs(piece) if k == 0 else None,
         "finish_reason": None}
        for k, delta in enumerate(deltas)
    ]


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
    calls: dict[int, ToolCallStream | None] = {}

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
                    calls[piece.index] = view.tool_stream()
                    role = {"role": "assistant", "content": ""}
                    yield chunk(
                        [{"index": piece.index, "delta": role, "logprobs": None, "finish_reason": None}]
                    )
                tool_stream = calls[piece.index]
                for delta_chunk in _piece_chunks(view, piece, tool_stream):
                    yield chunk([delta_chunk])
                if piece.finish_reason is not None:
                    done.add(piece.index)
                    reason: str | None = piece.finish_reason
                    if tool_stream is not None:
                        reason = tool_finish_reason(tool_stream.finish(), reason)
                    finish = {
                        "index": piece.index,
                        "delta": {},
                        "logprobs": None,
                        "finish_reason": reason,
                        "stop_reason": piece.stop_reason,
                    }
                    yield chunk([finish])
        if include_usage and tracked.final is not None:
            final = response_meta(fingerprint, "chat.completion.chunk", response_id, model)
            final["choices"] = []
            final["usage"] = usage([tracked.final])
            yield sse_event(final)
    except Exception as error:  # the stream has started: report in-band
        yield sse_event(as_api_error(error).body())
    finally:
        tracked.close()
    yield SSE_DONE
