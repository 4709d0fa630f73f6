"""Request bodies of the OpenAI endpoints (pydantic, strict types); SGLang's `/generate` is in
`protocol_generate`.

Types are strict (a string where a number is expected is a 400, never coerced); unknown fields are
ignored like the OpenAI API does, except the features this server does not implement (images, audio,
logit_bias...), which are a 400 naming the field. Output constraints (`response_format`, `tools`, vLLM's
`structured_outputs` and `guided_*`) are mapped by `server.structured` and `server.tools`. Value ranges are
checked by `SamplingParams`, which names the offending parameter too. These models are the endpoints'
FastAPI body parameters, so `/openapi.json` documents them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from deterministic_inference.engine.admission import MIN_TEMPERATURE, REPETITION_PENALTY_RANGE
from deterministic_inference.engine.sampling_params import MAX_LOGPROBS, SEED_LIMIT, SamplingParams
from deterministic_inference.engine.structured_spec import StructuredOutput
from deterministic_inference.server import structured
from deterministic_inference.server.errors import APIError
from deterministic_inference.server.structured import Constraint
from deterministic_inference.server.tools import ToolPlan, parse_tools

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's legacy default for /v1/completions
MAX_STOP_STRINGS = 16  # each stop string is searched after every token
MAX_STOP_TOKEN_IDS = 1024


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


def _ranged(**schema: Any) -> Any:
    """An optional field whose published JSON schema states the range the server enforces. Only the
    schema says it here: `SamplingParams` (or the handler) checks the value and names the field."""
    return Field(default=None, json_schema_extra=schema)


_COUNT = {"minimum": 1}
_TEMPERATURE = {"minimum": 0, "description": f"0 = greedy, else at least {MIN_TEMPERATURE}"}
_REPETITION = {"minimum": REPETITION_PENALTY_RANGE[0], "maximum": REPETITION_PENALTY_RANGE[1]}
_SEED = {"minimum": 0, "maximum": SEED_LIMIT - 1}
_PENALTY = {"minimum": -2, "maximum": 2}
_TOP = {"minimum": 0, "maximum": MAX_LOGPROBS}
_STOP = {"maxItems": MAX_STOP_STRINGS, "minLength": 1, "items": {"minLength": 1}}
_STOP_IDS = {"maxItems": MAX_STOP_TOKEN_IDS, "items": {"minimum": 0}}


class StreamOptions(_Body):
    """`stream_options`: only include_usage has an effect."""

    include_usage: bool | None = None


class _SamplingFields(_Body):
    """Sampling fields shared by completions and chat (vLLM-style extras included)."""

    model: str | None = None
    max_tokens: int | None = _ranged(**_COUNT)
    temperature: float | None = _ranged(**_TEMPERATURE)
    top_p: float | None = _ranged(exclusiveMinimum=0, maximum=1)
    top_k: int | None = _ranged(minimum=-1)
    min_p: float | None = _ranged(minimum=0, maximum=1)
    seed: int | None = _ranged(**_SEED)
    n: int | None = _ranged(**_COUNT)
    stop: str | list[str] | None = _ranged(**_STOP)
    stop_token_ids: list[int] | None = _ranged(**_STOP_IDS)
    presence_penalty: float | None = _ranged(**_PENALTY)
    frequency_penalty: float | None = _ranged(**_PENALTY)
    repetition_penalty: float | None = _ranged(**_REPETITION)
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM: json / regex / choice / grammar / ...
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names of the same constraints
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def reject_unsupported(self) -> None:
        """400 for fields whose feature is not implemented (when they ask for something)."""
        if self.logit_bias:
            raise unsupported("logit_bias")

    def vllm_constraints(self) -> list[Constraint | None]:
        """The vLLM-named constraints this request sets (`structured_outputs`, `guided_*`)."""
        guided = {name: getattr(self, name) for name in ("guided_json", "guided_regex", "guided_choice",
                                                         "guided_grammar")}
        return [structured.vllm_structured(self.structured_outputs), *structured.vllm_guided(guided)]

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        structured_output: StructuredOutput | None = None,
    ) -> SamplingParams:
        """Validated SamplingParams (InvalidRequestError names the field); OpenAI defaults for the rest."""
        return SamplingParams(
            structured_output=structured_output,
            n=_default(self.n, 1),
            max_tokens=max_tokens,
            temperature=_default(self.temperature, 1.0),
            top_p=_default(self.top_p, 1.0),
            top_k=_default(self.top_k, 0),
            min_p=_default(self.min_p, 0.0),
            seed=self.seed,
            presence_penalty=_default(self.presence_penalty, 0.0),
            frequency_penalty=_default(self.frequency_penalty, 0.0),
            repetition_penalty=_default(self.repetition_penalty, 1.0),
            stop=stop_strings(self.stop, "stop"),
            stop_token_ids=stop_token_ids(self.stop_token_ids, "stop_token_ids"),
            ignore_eos=bool(self.ignore_eos),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    @property
    def include_usage(self) -> bool:
        """True when the stream should end with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        json_schema_extra={"minItems": 1, "items": {"minimum": 0, "minItems": 1}}
    )
    logprobs: int | None = _ranged(**_TOP)
    echo: bool | None = None
    prompt_logprobs: int | None = _ranged(**_TOP)  # vLLM: per prompt token, the token and the top k
    return_token_ids: bool | None = None  # vLLM: choices carry prompt_token_ids and token_ids
    suffix: str | None = None
    best_of: int | None = _ranged(**_COUNT)
    response_format: dict[str, Any] | None = None  # vLLM: json_object / json_schema / structural_tag

    def reject_unsupported(self) -> None:
        super().reject_unsupported()
        if self.suffix:
            raise unsupported("suffix")
        if self.best_of is not None and self.best_of != _default(self.n, 1):
            raise unsupported("best_of", "best_of must equal n (or be omitted)")

    def constraint(self) -> Constraint | None:
        """The request's one output constraint (400 when it sets several)."""
        own = structured.response_format(self.response_format)
        return structured.only_one([own, *self.vllm_constraints()])

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: one string, several strings, one token list or several."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise APIError(400, "prompt: must not be empty", param="prompt", code="invalid_value")
        if all(isinstance(item, int) for item in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]


class ChatMessage(_Body):
    """One chat message; content is text or a list of text parts."""

    role: str = Field(json_schema_extra={"enum": ["system", "developer", "user", "assistant", "tool"]})
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # assistant: the calls it made (id, type, function name/arguments)
    tool_call_id: str | None = None  # tool: the id of the call this message answers


_CHAT_UNSUPPORTED = ("functions", "audio", "prediction", "web_search_options")


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    max_completion_tokens: int | None = _ranged(**_COUNT)
    logprobs: bool | None = None
    top_logprobs: int | None = _ranged(**_TOP)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None

    def reject_unsupported(self) -> None:
        super().reject_unsupported()
        extra = self.model_extra or {}
        for name in _CHAT_UNSUPPORTED:
            if extra.get(name):
                raise unsupported(name)
        if self.function_call not in (None, "none"):
            raise unsupported("function_call", "function_call is not supported; use tools and tool_choice")
        if self.modalities and any(m != "text" for m in self.modalities):
            raise unsupported("modalities", "only the 'text' modality is supported")
        if not self.messages:
            raise APIError(400, "messages: must not be empty", param="messages", code="invalid_value")

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as dicts (text parts joined; tool calls and call ids as sent), for `chat_history`."""
        return [
            {"role": m.role, "content": _message_text(index, m.content), "tool_calls": m.tool_calls,
             "tool_call_id": m.tool_call_id}
            for index, m in enumerate(self.messages)
        ]

    def tool_plan(self) -> ToolPlan:
        """The request's tools and tool choice, validated (400 naming the field)."""
        return parse_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    def constraint(self, plan: ToolPlan) -> Constraint | None:
        """The request's one output constraint: response_format, vLLM's fields or the tool-call grammar
        (400 when it sets several)."""
        grammar = plan.grammar()
        tool_param = "tool_choice" if self.tool_choice is not None else "tools"
        tools = None if grammar is None else (tool_param, grammar)
        return structured.only_one(
            [structured.response_format(self.response_format), *self.vllm_constraints(), tools]
        )

    def max_new_tokens(self) -> int | None:
        """max_completion_tokens, else max_tokens (None = the rest of the context)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_top_logprobs(self) -> int | None:
        """Engine `logprobs` value: alternatives per step when logprobs are asked for, else None."""
        if not self.logprobs:
            if self.top_logprobs:
                raise APIError(400, "top_logprobs: requires logprobs=true", param="top_logprobs")
            return None
        return self.top_logprobs or 0


def _message_text(index: int, content: str | list[dict[str, Any]] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part_index, part in enumerate(content):
        kind = part.get("type")
        if kind != "text":
            raise unsupported(
                f"messages[{index}].content[{part_index}].type", f"content type {kind!r} is not supported"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise APIError(400, "text part must have a string 'text'", param=f"messages[{index}].content")
        texts.append(text)
    return "".join(texts)


def stop_strings(value: str | list[str] | None, param: str) -> tuple[str, ...]:
    """The stop strings as a tuple; 400 when there are more than MAX_STOP_STRINGS."""
    stops = (value,) if isinstance(value, str) else tuple(value or ())
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(
            400, f"{param}: {len(stops)} stop strings; at most {MAX_STOP_STRINGS}", param=param,
            code="invalid_value",
        )
    return stops


def stop_token_ids(value: list[int] | None, param: str) -> tuple[int, ...]:
    """The stop token ids as a tuple; 400 when there are more than MAX_STOP_TOKEN_IDS."""
    ids = tuple(value or ())
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise APIError(
            400, f"{param}: {len(ids)} stop token ids; at most {MAX_STOP_TOKEN_IDS}", param=param,
            code="invalid_value",
        )
    return ids


def unsupported(param: str, message: str | None = None) -> APIError:
    """400 for a feature this server does not implement."""
    return APIError(
        400, message or f"{param} is not supported by this server", param=param, code="unsupported"
    )


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value
