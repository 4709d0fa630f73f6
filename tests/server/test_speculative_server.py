"""A server with `--speculative-config` over real HTTP and the official openai client: the same tokens,
logprob bits and system_fingerprint as a plain server, the speculation metrics on /metrics, and each
request's accepted draft tokens in its usage."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.engine.speculative import SpeculativeConfig
from deterministic_inference.server.app import ServerSettings
from tests.server.harness import TINY_NAME, RunningServer, thread_server, tiny_config
from tests.server.test_metrics import scrape, total, value
from tests.tiny_models import TinyModel

NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3)
STREAM_USAGE: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}}
PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat"


@pytest.fixture(scope="module")
def servers(tiny_llama_dir: TinyModel) -> Iterator[tuple[RunningServer, RunningServer]]:
    settings = ServerSettings(served_model_name=TINY_NAME)
    with thread_server(tiny_config(tiny_llama_dir), settings) as plain:
        with thread_server(tiny_config(tiny_llama_dir, speculative_config=NGRAM), settings) as speculative:
            yield plain, speculative


def complete(server: RunningServer, **body: Any) -> Any:
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(model=TINY_NAME, prompt=PROMPT, **body)


def signature(response: Any) -> tuple[Any, ...]:
    choice = response.choices[0]
    logprobs = choice.logprobs
    return (
        choice.text,
        choice.finish_reason,
        tuple(logprobs.tokens),
        tuple(struct.pack("<f", v) for v in logprobs.token_logprobs),
        tuple(tuple(sorted(top.items())) for top in logprobs.top_logprobs),
        response.system_fingerprint,
    )


def test_speculative_server_equals_plain_and_counts(servers: tuple[RunningServer, RunningServer]) -> None:
    plain, speculative = servers
    before = scrape(speculative)
    for body in ({"temperature": 0.0}, {"temperature": 0.1, "seed": 4}, {"temperature": 0.8, "seed": 9}):
        settings = {"max_tokens": 24, "logprobs": 2, **body}
        assert signature(complete(speculative, **settings)) == signature(complete(plain, **settings))
    after = scrape(speculative)

    def grew(name: str) -> float:
        return value(after, name, model_name=TINY_NAME) - value(before, name, model_name=TINY_NAME)

    drafts = grew("vllm:spec_decode_num_drafts_total")
    accepted = grew("vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and accepted > 0
    assert grew("vllm:spec_decode_num_draft_tokens_total") >= accepted
    assert grew("vllm:spec_decode_num_emitted_tokens_total") <= accepted + drafts
    assert total(after, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == value(
        after, "vllm:spec_decode_num_accepted_tokens_total", model_name=TINY_NAME
    )
    histogram_count = value(after, "detinf_spec_decode_acceptance_length_count", model_name=TINY_NAME)
    assert histogram_count == value(after, "vllm:spec_decode_num_drafts_total", model_name=TINY_NAME)
    assert value(scrape(plain), "vllm:spec_decode_num_drafts_total", model_name=TINY_NAME) == 0


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: TinyModel) -> Engine:
    """An engine with the speculative server's settings, run offline: its per-request counts."""
    return Engine(tiny_config(tiny_llama_dir, speculative_config=NGRAM))


def offline_counts(engine: Engine, prompt_ids: list[int], body: dict[str, Any]) -> tuple[int, int]:
    """(accepted, rejected) draft tokens of one request run alone by the offline engine."""
    params = SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"],
                            seed=body.get("seed"), n=body.get("n", 1))
    counts = engine.generate([prompt_ids], params)[0].speculation
    assert counts is not None
    return counts.num_accepted_tokens, counts.num_rejected_tokens


def details(usage: Any) -> tuple[int, int]:
    """(accepted, rejected) from a usage object parsed by the openai SDK."""
    found = usage.completion_tokens_details
    return found.accepted_prediction_tokens, found.rejected_prediction_tokens


def streamed_usage(stream: Any) -> Any:
    """The usage of a stream with include_usage: only its last chunk carries one."""
    chunks = list(stream)
    assert all(chunk.usage is None for chunk in chunks[:-1])
    return chunks[-1].usage


def test_usage_reports_accepted_draft_tokens(
    servers: tuple[RunningServer, RunningServer], offline: Engine
) -> None:
    """usage.completion_tokens_details carries the engine's own per-request accepted / rejected draft
    counts (chat and completions, streamed and not, n > 1 summed over choices); the sum over requests
    is what /metrics counted; a server without speculation has no such field."""
    plain, speculative = servers
    client: Any = openai.OpenAI(base_url=speculative.v1, api_key="unused", max_retries=0, timeout=120)
    prompt_ids = offline.encode_prompt(PROMPT)
    messages = [{"role": "user", "content": PROMPT}]
    chat_ids = offline.encode_prompt(offline.tokenizer.apply_chat_template(messages))
    before = scrape(speculative)
    reported = []
    for body in ({"temperature": 0.0, "max_tokens": 24}, {"temperature": 0.8, "seed": 9, "max_tokens": 20},
                 {"temperature": 0.1, "seed": 4, "max_tokens": 16, "n": 2}):
        expected = offline_counts(offline, prompt_ids, body)
        for stream in (False, True):
            extra = STREAM_USAGE if stream else {}
            response = client.completions.create(model=TINY_NAME, prompt=PROMPT, **body, **extra)
            usage = streamed_usage(response) if stream else response.usage
            assert details(usage) == expected, (body, stream)
            reported.append(expected)
        expected = offline_counts(offline, chat_ids, body)
        for stream in (False, True):
            extra = STREAM_USAGE if stream else {}
            response = client.chat.completions.create(model=TINY_NAME, messages=messages, **body, **extra)
            usage = streamed_usage(response) if stream else response.usage
            assert details(usage) == expected, (body, stream, "chat")
            reported.append(expected)
    after = scrape(speculative)
    assert sum(accepted for accepted, _ in reported) > 0
    for name, index in (("vllm:spec_decode_num_accepted_tokens_total", 0),
                        ("vllm:spec_decode_num_draft_tokens_total", None)):
        grew = value(after, name, model_name=TINY_NAME) - value(before, name, model_name=TINY_NAME)
        want = sum(pair[0] if index == 0 else pair[0] + pair[1] for pair in reported)
        assert grew == want, name
    plain_usage = complete(plain, max_tokens=8, temperature=0.0).usage
    assert plain_usage.completion_tokens_details is None
