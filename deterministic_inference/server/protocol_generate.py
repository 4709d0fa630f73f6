"""SGLang's native POST /generate request body (pydantic, strict types), as SGLang's clients send it.

One prompt (``text`` or ``input_ids``) or a batch of them. ``sampling_params``, ``return_logprob``,
``logprob_start_len`` and ``top_logprobs_num`` may each be one value for every prompt or a list with one
value per prompt, as in SGLang. `GenerateRequest.prompt_options` resolves them into one
`PromptOptions` per prompt; `PromptOptions.params` gives that prompt's `SamplingParams` once its token
count is known (``logprob_start_len`` is checked against it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import ConfigDict

from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.engine.structured_spec import StructuredOutput
from deterministic_inference.server import structured
from deterministic_inference.server.errors import APIError
from deterministic_inference.server.protocol import (
    _COUNT,
    _PENALTY,
    _REPETITION,
    _SEED,
    _STOP,
    _STOP_IDS,
    _TEMPERATURE,
    _TOP,
    _Body,
    _default,
    _ranged,
    stop_strings,
    stop_token_ids,
    unsupported,
)
from deterministic_inference.server.structured import Constraint

DEFAULT_GENERATE_MAX_TOKENS = 128  # SGLang's default max_new_tokens
T = TypeVar("T")


class GenerateSamplingParams(_Body):
    """SGLang `sampling_params` (the subset this engine implements)."""

    max_new_tokens: int | None = _ranged(**_COUNT)
    temperature: float | None = _ranged(**_TEMPERATURE)
    top_p: float | None = _ranged(exclusiveMinimum=0, maximum=1)
    top_k: int | None = _ranged(minimum=-1)
    min_p: float | None = _ranged(minimum=0, maximum=1)
    sampling_seed: int | None = _ranged(**_SEED)
    n: int | None = _ranged(**_COUNT)
    stop: str | list[str] | None = _ranged(**_STOP)
    stop_token_ids: list[int] | None = _ranged(**_STOP_IDS)
    presence_penalty: float | None = _ranged(**_PENALTY)
    frequency_penalty: float | None = _ranged(**_PENALTY)
    repetition_penalty: float | None = _ranged(**_REPETITION)
    ignore_eos: bool | None = None
    json_schema: str | None = None  # a JSON schema as JSON text (SGLang's form)
    regex: str | None = None
    ebnf: str | None = None  # GBNF, root rule `root`
    structural_tag: str | None = None  # JSON text of a structural-tag spec

    def constraint(self) -> Constraint | None:
        """This prompt's output constraint (at most one of json_schema, regex, ebnf, structural_tag)."""
        found: list[Constraint | None] = []
        for name, build in _CONSTRAINTS.items():
            value = getattr(self, name)
            if value is not None:
                param = f"sampling_params.{name}"
                found.append((param, build(value, param)))
        return structured.only_one(found)


_CONSTRAINTS = {
    "json_schema": structured.json_schema,
    "regex": structured.regex,
    "ebnf": structured.ebnf,
    "structural_tag": structured.structural_tag,
}


@dataclass(frozen=True)
class PromptOptions:
    """What one prompt of a /generate request asks for."""

    sampling: GenerateSamplingParams
    return_logprob: bool
    logprob_start_len: int  # -1: output logprobs only (SGLang's default)
    top_logprobs_num: int  # top alternatives per position (0: none, and no *_top_logprobs keys)
    return_text_in_logprobs: bool  # third element of each logprob entry: the token's text (else null)

    def input_start(self, prompt_len: int) -> int:
        """First prompt position whose token appears in `input_token_logprobs` (prompt_len: none)."""
        return prompt_len if self.logprob_start_len < 0 else self.logprob_start_len

    def params(
        self, prompt_len: int, param: str, structured_output: StructuredOutput | None = None
    ) -> SamplingParams:
        """Validated SamplingParams with SGLang's defaults (temperature 1, 128 new tokens). Prompt logprobs
        are computed only when `input_token_logprobs` will hold a value (start < prompt_len - 1)."""
        if self.return_logprob and self.logprob_start_len > prompt_len:
            raise APIError(
                400, f"logprob_start_len: {self.logprob_start_len} is more than the {prompt_len} tokens of "
                f"{param}; use a smaller value", param="logprob_start_len", code="invalid_value",
            )
        sp = self.sampling
        wants_prompt = self.return_logprob and self.input_start(prompt_len) < prompt_len - 1
        top = self.top_logprobs_num if self.return_logprob else None
        return SamplingParams(
            structured_output=structured_output,
            n=_default(sp.n, 1),
            max_tokens=_default(sp.max_new_tokens, DEFAULT_GENERATE_MAX_TOKENS),
            temperature=_default(sp.temperature, 1.0),
            top_p=_default(sp.top_p, 1.0),
            top_k=_default(sp.top_k, 0),
            min_p=_default(sp.min_p, 0.0),
            seed=sp.sampling_seed,
            presence_penalty=_default(sp.presence_penalty, 0.0),
            frequency_penalty=_default(sp.frequency_penalty, 0.0),
            repetition_penalty=_default(sp.repetition_penalty, 1.0),
            stop=stop_strings(sp.stop, "sampling_params.stop"),
            stop_token_ids=stop_token_ids(sp.stop_token_ids, "sampling_params.stop_token_ids"),
            ignore_eos=bool(sp.ignore_eos),
            logprobs=top,
            prompt_logprobs=top if wants_prompt else None,
        )


class GenerateRequest(_Body):
    """SGLang's native POST /generate: exactly one of `text` and `input_ids`."""

    model_config = ConfigDict(
        json_schema_extra={"oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}]}
    )

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = _ranged(items={"minimum": 0})
    sampling_params: GenerateSamplingParams | list[GenerateSamplingParams] | None = None
    stream: bool | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = _ranged(minimum=-1, items={"minimum": -1})
    top_logprobs_num: int | list[int] | None = _ranged(**_TOP, items=_TOP)
    return_text_in_logprobs: bool | None = None
    token_ids_logprob: Any = None

    def prompts(self) -> tuple[list[str | list[int]], bool]:
        """(prompts, batched): from `text` or `input_ids`, exactly one of them."""
        if (self.text is None) == (self.input_ids is None):
            raise APIError(400, "give exactly one of text or input_ids", param="text")
        if isinstance(self.text, str):
            return [self.text], False
        if self.text is not None:
            return list(self.text), True
        ids = self.input_ids or []
        if ids and all(isinstance(item, int) for item in ids):
            return [list(ids)], False  # type: ignore[arg-type]
        return list(ids), True  # type: ignore[arg-type]

    def prompt_options(self, count: int) -> list[PromptOptions]:
        """One PromptOptions per prompt; a list-valued field must have one entry per prompt."""
        if self.token_ids_logprob:
            raise unsupported("token_ids_logprob")
        sampling = _per_prompt(self.sampling_params, count, "sampling_params", GenerateSamplingParams())
        logprob = _per_prompt(self.return_logprob, count, "return_logprob", False)
        starts = _per_prompt(self.logprob_start_len, count, "logprob_start_len", -1)
        tops = _per_prompt(self.top_logprobs_num, count, "top_logprobs_num", 0)
        for value in starts:
            if value < -1:  # the published schema states the ranges; the models do not enforce them
                raise APIError(400, f"logprob_start_len: {value} must be >= -1", param="logprob_start_len")
        for value in tops:
            if not 0 <= value <= _TOP["maximum"]:
                raise APIError(400, f"top_logprobs_num: {value} must be between 0 and {_TOP['maximum']}",
                               param="top_logprobs_num")
        text = bool(self.return_text_in_logprobs)
        return [PromptOptions(sampling[i], bool(logprob[i]), starts[i], tops[i], text) for i in range(count)]


def _per_prompt(value: T | list[T] | None, count: int, param: str, default: T) -> list[T]:
    """`value` for each of `count` prompts: a single value is shared, a list gives one per prompt."""
    if value is None:
        return [default] * count
    if isinstance(value, list):
        if len(value) != count:
            raise APIError(
                400, f"{param}: {len(value)} values for {count} prompts; give one value or one per prompt",
                param=param, code="invalid_value",
            )
        return [default if item is None else item for item in value]
    return [value] * count
