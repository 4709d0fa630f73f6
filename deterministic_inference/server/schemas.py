"""Response bodies, as pydantic models: they document every endpoint's answers in `/openapi.json`.

Handlers write their JSON with `formatting.json_response` (exact float text, no re-validation); these
models describe that JSON, and the server tests validate real responses against the published schema.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from deterministic_inference.server.schemas_tools import ToolCall, ToolCallDelta

LogprobPair = list[float | int | str | None]  # SGLang's [logprob or null, token id, token text or null]


class ErrorDetail(BaseModel):
    """The error itself: a message for people, the OpenAI error type, the request field it concerns
    (`param`, null when none) and a machine-readable `code`."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error: 4xx for bad requests, 503 when the engine cannot serve, 500 for one failed request."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    """How the prompt was processed: the part of it served from the prefix cache."""

    cached_tokens: int = Field(description="prompt tokens served from the prefix cache")


class CompletionTokensDetails(BaseModel):
    """Speculative decoding's share of the completion (present only when the server speculates): the
    draft tokens verified and kept, and those verified and not kept. The tokens themselves are plain
    decoding's either way."""

    accepted_prediction_tokens: int = Field(description="draft tokens equal to the token chosen there")
    rejected_prediction_tokens: int = Field(description="draft tokens verified and not kept")


class Usage(BaseModel):
    """Token counts of one response, over all its prompts and choices."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = Field(
        default=None, description="only with --speculative-config: accepted and rejected draft tokens"
    )


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs (the first echoed prompt token has no logprob: null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    """One generated text of /v1/completions; `stop_reason` is the stop string or token id that
    ended it, if one did."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    """POST /v1/completions (a streamed response sends these as `data:` events, usage last)."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    """A candidate token at one position: its text, logprob (float32 value) and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    """A chosen token with its logprob and the `top_logprobs` most likely candidates at its position."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """Logprobs of a chat choice: one entry per generated token (null when none were asked)."""

    content: list[TokenLogprob] | None
    refusal: str | None = None


class ChatMessageOut(BaseModel):
    """The assistant message of a chat choice."""

    role: str
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None  # present when the answer holds tool calls


class ChatChoice(BaseModel):
    """One generated message of /v1/chat/completions; `stop_reason` as in CompletionChoice."""

    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    """POST /v1/chat/completions without streaming."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    """What a streamed chat event adds to its choice: the role once, then pieces of content."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None  # streamed tool-call pieces


class ChatChunkChoice(BaseModel):
    """One choice in a streamed chat event: its delta, the logprobs of the tokens in it, and the
    finish reason in its last event."""

    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a streamed chat completion."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class GenerateFinishReason(BaseModel):
    """Why a /generate output ended (SGLang's form): `length` with the token count, or `stop` with the
    stop string or token id `matched`."""

    type: str
    length: int | None = None
    matched: int | str | None = None


class GenerateMeta(BaseModel):
    """/generate metadata of one output: its finish reason, token counts, fingerprint and, when asked,
    the logprobs as SGLang's [logprob, token id, text] triples."""

    id: str
    finish_reason: GenerateFinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    system_fingerprint: str
    input_token_logprobs: list[LogprobPair] | None = None
    output_token_logprobs: list[LogprobPair] | None = None
    output_token_logprobs_length: int | None = None
    input_top_logprobs: list[list[LogprobPair] | None] | None = None
    output_top_logprobs: list[list[LogprobPair]] | None = None


class GenerateItem(BaseModel):
    """POST /generate: one object for one prompt with n == 1, else a list (prompt major, choice minor)."""

    text: str
    output_ids: list[int]
    index: int
    meta_info: GenerateMeta


class ModelCard(BaseModel):
    """The served model in GET /v1/models: its name, context length (`max_model_len`) and fingerprint."""

    id: str
    object: str
    created: int
    owned_by: str
    root: str
    max_model_len: int
    system_fingerprint: str


class ModelList(BaseModel):
    """GET /v1/models: the one model this server serves."""

    object: str
    data: list[ModelCard]


class Health(BaseModel):
    """GET /healthz: 200 {"status": "ok"} while serving, else 503 with a status and a one-line error."""

    status: str
    system_fingerprint: str | None = None
    error: str | None = None


class FlushResult(BaseModel):
    """POST /flush_cache: how many cached KV blocks were dropped (blocks of running requests stay)."""

    flushed_blocks: int
    system_fingerprint: str


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for these error statuses (all with ErrorResponse bodies)."""
    described = {
        400: "invalid request (the message and param name the field)",
        401: "missing or wrong API key",
        404: "unknown model",
        429: "the request queue is full; retry after Retry-After seconds",
        500: "this request failed inside the server; other requests were not affected",
        503: "the engine is loading, shutting down or stopped; retry (after a restart)",
    }
    return {status: {"model": ErrorResponse, "description": described[status]} for status in statuses}


def event_stream(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The 200 entry of an endpoint that streams `data: <model JSON>` events when `stream` is true (its
    event schema is filled in by `sse_event_schema` once the components exist)."""
    return {
        200: {
            "description": f"JSON, or with stream=true server-sent events of {model.__name__} ending in "
            "`data: [DONE]` (an error after the stream started comes in-band as an ErrorResponse event)",
            "content": {"text/event-stream": {"schema": {"type": "object"}}},
        }
    }


def sse_event_schema(model: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.1: the stream's `schema` describes each event): its `data` is
    `[DONE]` or JSON holding a `model` or an ErrorResponse."""
    payload = {"anyOf": [{"$ref": _ref(model)}, {"$ref": _ref(ErrorResponse)}]}
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {"type": "string", "contentMediaType": "application/json", "contentSchema": payload},
                ]
            }
        },
    }


def _ref(model: type[BaseModel]) -> str:
    return f"#/components/schemas/{model.__name__}"
