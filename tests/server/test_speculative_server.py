"""A server with `--speculative-config` over real HTTP and the official openai client: the same tokens,
logprob bits and system_fingerprint as a plain server, and the speculation metrics on /metrics."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from deterministic_inference.engine.speculative import SpeculativeConfig
from deterministic_inference.server.app import ServerSettings
from tests.server.harness import TINY_NAME, RunningServer, thread_server, tiny_config
from tests.server.test_metrics import scrape, total, value
from tests.tiny_models import TinyModel

NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3)
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
