"""What each field of the API means, for the generated API reference (reference_api.py).

The published schema (server/protocol.py, server/schemas.py) states types and ranges; these texts add
the meaning and the default. A description in the schema itself wins over these. Keyed by field name,
with (schema, field) entries where one name means different things in different objects. A field
with no entry is listed without a description, and `gen_reference.py` names it on stderr.
"""

from __future__ import annotations

FIELD_DOCS: dict[str, str] = {
    # sampling (requests)
    "model": "the served model name (`GET /v1/models`); may be omitted; another name is a 404",
    "max_tokens": "most tokens to generate per choice",
    "temperature": "0 = greedy (argmax, ties to the lowest token id), else at least 1e-6; default 1",
    "top_p": "keep the most likely tokens whose probabilities reach this mass; default 1 (off)",
    "top_k": "keep the k most likely tokens; 0 or -1 = off (default)",
    "min_p": "keep tokens with probability >= min_p x the most likely one's; default 0 (off)",
    "seed": "sampling seed, 0 to 2^63 - 1; default: the server's `--default-seed`, so every request is "
    "reproducible",
    "n": "number of choices (default 1); choice i uses a seed derived from (seed, i)",
    "stop": "a string or up to 16 strings that end a choice when generated (not included in the text)",
    "stop_token_ids": "token ids that end a choice (besides the model's end-of-sequence tokens)",
    "presence_penalty": "subtracted from the logit of every token already generated; default 0",
    "frequency_penalty": "subtracted once per earlier occurrence in the output; default 0",
    "repetition_penalty": "divides positive (multiplies negative) logits of tokens seen in prompt or output; "
    "default 1 (off)",
    "ignore_eos": "keep generating after the end-of-sequence token, up to the token limit",
    "include_stop_str_in_output": "keep the matched stop string at the end of the text",
    "stream": "answer with server-sent events instead of one JSON document",
    "stream_options": "with `include_usage: true` the stream ends with a chunk carrying `usage`",
    "include_usage": "send a last chunk with the token counts",
    "user": "accepted and ignored (OpenAI's end-user id)",
    "logit_bias": "not supported: a non-empty value is a 400",
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists; several "
    "prompts answer one choice list (prompt-major)",
    "echo": "prepend the prompt to the text (with `logprobs`, also the prompt tokens' logprobs)",
    "suffix": "not supported: a non-empty value is a 400",
    "best_of": "accepted only equal to `n`",
    "messages": "the conversation, rendered through the model's chat template",
    "max_completion_tokens": "most tokens to generate (wins over `max_tokens`); default: the rest of the "
    "context",
    "top_logprobs": "alternatives per token (0-20) with `logprobs: true`",
    "response_format": "`text` (default), `json_object`, or `json_schema` with `json_schema.schema`: the "
    "answer follows it (see Structured outputs); on completions also vLLM's `structural_tag`",
    "tools": "functions the model may call: `{\"type\": \"function\", \"function\": {name, description, "
    "parameters}}`",
    "tool_choice": "`none`, `auto` (default with tools), `required`, or `{\"type\": \"function\", "
    "\"function\": {\"name\": ...}}`; the grammar makes every call valid",
    "parallel_tool_calls": "false: at most one call per answer (default true)",
    "structured_outputs": "vLLM: one of `json` (a schema), `regex`, `choice` (strings), `grammar` (GBNF), "
    "`json_object`, `structural_tag`; the output follows it",
    "guided_json": "vLLM's older name of `structured_outputs.json`",
    "guided_regex": "vLLM's older name of `structured_outputs.regex`",
    "guided_choice": "vLLM's older name of `structured_outputs.choice`",
    "guided_grammar": "vLLM's older name of `structured_outputs.grammar` (GBNF, root rule `root`)",
    "json_schema": "SGLang: the output follows this JSON schema (JSON text)",
    "regex": "SGLang: the output matches this regular expression",
    "ebnf": "SGLang: the output follows this GBNF grammar (root rule `root`)",
    "structural_tag": "SGLang: JSON text of a structural tag (`structures` with begin / schema / end, "
    "`triggers`)",
    "tool_call_id": "tool messages: the id of the call this message answers",
    "arguments": "the arguments as JSON text, as the model wrote them (streamed: a fragment)",
    "function_call": "only `none`; functions are not supported",
    "modalities": 'only `["text"]`',
    "role": "system, developer (treated as system), user, assistant or tool",
    "content": 'text, or a list of `{"type": "text", "text": ...}` parts',
    "name": "accepted and ignored",
    "tool_calls": "assistant: the calls it made (`id`, `type`, `function` with `name` and `arguments`)",
    # /generate
    "text": "the generated text",
    "input_ids": "prompt token ids, or a list of them (give `text` or `input_ids`)",
    "sampling_params": "SGLang's sampling parameters",
    "return_logprob": "add `output_token_logprobs` (and `output_top_logprobs`) to `meta_info`",
    "top_logprobs_num": "alternatives per token with `return_logprob` (0-20)",
    "max_new_tokens": "most tokens to generate per choice (default 128)",
    "sampling_seed": "sampling seed, 0 to 2^63 - 1; default: the server's `--default-seed`",
    "prompt_logprobs": "vLLM: per prompt token, its logprob and this many alternatives (0-20)",
    "return_token_ids": "vLLM: choices also carry `prompt_token_ids` and `token_ids`",
    "logprob_start_len": "first prompt position whose logprob is returned in `input_token_logprobs`; -1 "
    "(default) = output logprobs only; one value or one per prompt",
    "return_text_in_logprobs": "put each token's text as the third element of logprob entries (else null)",
    "token_ids_logprob": "not supported: a non-empty value is a 400",
    "model_path": "directory on the server with the new weights as safetensors",
    "load_format": "`safetensors` or `auto`",
    # responses
    "id": "response id (not part of the output: differs between calls)",
    "object": "the object type, as OpenAI names it",
    "created": "Unix time of the response (not part of the output)",
    "system_fingerprint": "the engine's fingerprint: equal fingerprints give equal bits for equal requests",
    "choices": "one per prompt and choice, prompt-major",
    "usage": "token counts",
    "index": "position of the choice in the response",
    "message": "the generated assistant message",
    "delta": "the text added since the previous chunk",
    "logprobs": "log-probabilities of the generated tokens (float32 values)",
    "finish_reason": "`stop` (end of sequence or a stop string / token), `length` (token limit); null "
    "while streaming",
    "stop_reason": "the stop string or token id that ended the choice, else null",
    "refusal": "always null",
    "tokens": "the generated tokens as text pieces",
    "token_logprobs": "logprob of each token (null for the first prompt token with `echo`)",
    "text_offset": "character offset of each token in the text",
    "token": "the token as text",
    "logprob": "its log-probability (float32 value)",
    "bytes": "the token's UTF-8 bytes",
    "prompt_tokens": "tokens in the prompt(s)",
    "completion_tokens": "tokens generated",
    "total_tokens": "prompt + completion tokens",
    "prompt_tokens_details": "`cached_tokens`: prompt tokens served from the prefix cache",
    "cached_tokens": "prompt tokens served from the prefix cache",
    "error": "the error (see the status codes on API compatibility)",
    "param": "the request field at fault, or null",
    "code": "machine-readable error code (`invalid_value`, `unsupported`, `queue_full`...)",
    "flushed_blocks": "prefix-cache blocks dropped",
    "status": "`ok`, `loading`, `stopping` or `failed`",
    "owned_by": "always `detinf`",
    "root": "the model's own name",
    "max_model_len": "longest prompt + output, in tokens",
    "data": "the served model (one)",
    "output_ids": "generated token ids",
    "meta_info": "counts, finish reason, fingerprint, logprobs",
    "output_token_logprobs": "`[logprob, token_id, text or null]` per generated token",
    "output_top_logprobs": "per generated token, a list of `[logprob, token_id, text or null]` alternatives",
    "length": "with type `length`: tokens generated",
    "input_token_logprobs": "`[logprob, token_id, text or null]` per prompt token from `logprob_start_len`",
    "input_top_logprobs": "per prompt token, its alternatives (null where none)",
    "output_token_logprobs_length": "number of entries in `output_token_logprobs`",
    "success": "true: new requests run on the new weights",
    "weights_digest": "sha256 of the new weights as the engine computes them (part of the fingerprint)",
    "prompt_token_ids": "the prompt's token ids",
    "token_ids": "the generated token ids",
    "matched": "with type `stop`: the stop string or token id that matched",
}

SCHEMA_FIELD_DOCS: dict[tuple[str, str], str] = {
    ("CompletionRequest", "max_tokens"): "most tokens to generate per choice (default 16, as OpenAI)",
    ("ChatCompletionRequest", "max_tokens"): "most tokens to generate (default: the rest of the context)",
    ("CompletionRequest", "response_format"): "vLLM: `json_object`, `json_schema` or `structural_tag`; the "
    "output follows it",
    ("CompletionRequest", "logprobs"): "return the logprobs of the generated tokens with this many "
    "alternatives each (0-20)",
    ("ChatCompletionRequest", "logprobs"): "return the logprobs of the generated tokens",
    ("GenerateRequest", "text"): "the prompt, or a list of prompts (give `text` or `input_ids`)",
    ("GenerateRequest", "stream"): "stream each choice's cumulative object as server-sent events",
    ("ChatLogprobs", "content"): "one entry per generated token",
    ("ChatMessageOut", "content"): "the generated text",
    ("ChatDelta", "content"): "text added since the previous chunk",
    ("ChatDelta", "role"): "`assistant`, in the first chunk",
    ("ChatMessageOut", "role"): "`assistant`",
    ("TokenLogprob", "top_logprobs"): "the most likely alternatives at this position",
    ("CompletionLogprobs", "top_logprobs"): "per token, the most likely alternatives (token -> logprob)",
    ("ErrorDetail", "message"): "what is wrong and how to fix it",
    ("ErrorDetail", "type"): "`invalid_request_error`, `authentication_error`, `rate_limit_error`, "
    "`server_error` or `service_unavailable`",
    ("GenerateFinishReason", "type"): "`length` or `stop`",
    ("Health", "error"): "why the engine is not serving (when it failed)",
    ("GenerateMeta", "id"): "request id and choice index",
    ("ToolCall", "type"): "`function`",
    ("ToolCallDelta", "type"): "`function`, in a call's first delta",
    ("ToolCall", "function"): "the function's `name` and its `arguments`",
    ("ToolCallDelta", "function"): "`name` and empty `arguments` in a call's first delta, then `arguments` "
    "fragments",
    ("ChatMessageOut", "tool_calls"): "the answer's tool calls (absent when there are none)",
    ("ChatDelta", "tool_calls"): "tool-call pieces (see ToolCallDelta)",
    ("GenerateMeta", "finish_reason"): '`{"type": "length", "length": N}` or `{"type": "stop", '
    '"matched": ...}`',
}


def field_doc(schema_name: str, field: str) -> str | None:
    """The description of `field` in `schema_name`, or None."""
    return SCHEMA_FIELD_DOCS.get((schema_name, field), FIELD_DOCS.get(field))
