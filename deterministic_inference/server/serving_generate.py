"""SGLang-style POST /generate, for users migrating from SGLang (`sampling_params.sampling_seed`).

One prompt (text or input_ids) with n == 1 answers one object; a batch or n > 1 answers a list (prompt
major, choice minor). Streaming sends, for each choice the engine's delta changed, the choice's
cumulative object (SGLang's format, built from the deltas folded so far), then `data: [DONE]`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from deterministic_inference.engine.outputs import CompletionOutput
from deterministic_inference.server.errors import as_api_error
from deterministic_inference.server.formatting import SSE_DONE, finite, json_response, sse_event
from deterministic_inference.server.protocol import GenerateRequest
from deterministic_inference.server.serving import (
    ServingContext,
    Tracked,
    close_all,
    merged,
    results,
    unless_disconnected,
)
from deterministic_inference.server.serving_completions import SSE_HEADERS


async def generate(ctx: ServingContext, body: GenerateRequest, request: Request) -> Response:
    """Handle /generate."""
    prompts, batched = body.prompts()
    params = body.params()
    fingerprint = ctx.info().system_fingerprint
    param = "text" if body.text is not None else "input_ids"
    ctx.check_capacity(len(prompts), params.n, param)
    ids = [p if isinstance(p, list) else await ctx.encode(p, param) for p in prompts]
    tracked = await ctx.submit(ids, params, "gen", param, "sampling_params.max_new_tokens")
    with_logprobs = bool(body.return_logprob)
    single = not batched and params.n == 1
    if body.stream:
        return StreamingResponse(
            _stream(tracked, fingerprint, with_logprobs), media_type="text/event-stream", headers=SSE_HEADERS
        )
    try:
        outputs = await unless_disconnected(request, results(tracked))
    finally:
        close_all(tracked)
    items = [
        _item(o.request_id, len(o.prompt_token_ids), o.num_cached_tokens, c, fingerprint, with_logprobs)
        for o in outputs
        for c in o.outputs
    ]
    return json_response(items[0] if single else items)


def _finish_reason(choice: CompletionOutput) -> dict[str, Any] | None:
    if choice.finish_reason is None:
        return None
    if choice.finish_reason == "length":
        return {"type": "length", "length": len(choice.token_ids)}
    return {"type": choice.finish_reason, "matched": choice.stop_reason}


def _item(
    request_id: str,
    prompt_tokens: int,
    cached_tokens: int,
    choice: CompletionOutput,
    fingerprint: str,
    with_logprobs: bool,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": f"{request_id}-{choice.index}",
        "finish_reason": _finish_reason(choice),
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(choice.token_ids),
        "cached_tokens": cached_tokens,
        "system_fingerprint": fingerprint,
    }
    if with_logprobs:
        meta["output_token_logprobs"] = [
            [finite(lp), token, None] for token, lp in zip(choice.token_ids, choice.logprobs, strict=True)
        ]
        meta["output_top_logprobs"] = [
            [[finite(lp), token, None] for token, lp in step] for step in choice.top_logprobs
        ]
    return {
        "text": choice.text,
        "output_ids": list(choice.token_ids),
        "index": choice.index,
        "meta_info": meta,
    }


async def _stream(tracked: list[Tracked], fingerprint: str, with_logprobs: bool) -> AsyncIterator[str]:
    try:
        async for index, delta in merged(tracked):
            assembler = tracked[index].assembler
            assert assembler is not None  # set from the first delta
            for piece in delta.outputs:
                choice = assembler.choices[piece.index]  # cumulative (SGLang streams whole objects)
                item = _item(
                    delta.request_id,
                    len(assembler.prompt.token_ids),
                    assembler.num_cached_tokens,
                    choice,
                    fingerprint,
                    with_logprobs,
                )
                item["index"] = index * len(assembler.choices) + choice.index
                yield sse_event(item)
    except Exception as error:  # the stream has started: report in-band
        yield sse_event(as_api_error(error).body())
    finally:
        close_all(tracked)
    yield SSE_DONE
