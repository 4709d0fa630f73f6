"""Bearer-token auth: 401 with an OpenAI error body everywhere but /healthz."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from deterministic_inference.server.app import ServerSettings
from deterministic_inference.server.middleware import bearer_matches
from tests.server.harness import TINY_NAME, RunningServer, thread_server, tiny_config
from tests.tiny_models import TinyModel

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def secured(tiny_llama_dir: TinyModel) -> Iterator[RunningServer]:
    with thread_server(
        tiny_config(tiny_llama_dir), ServerSettings(api_key=KEY, served_model_name=TINY_NAME)
    ) as s:
        yield s


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY}],
)
@pytest.mark.parametrize(
    "method_path",
    [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("GET", "/metrics"),
        ("POST", "/flush_cache"),
        ("POST", "/generate"),
    ],
)
def test_missing_or_wrong_key_is_401(
    secured: RunningServer, headers: dict[str, str], method_path: tuple[str, str]
) -> None:
    method, path = method_path
    response = httpx.request(method, secured.base_url + path, headers=headers, json={"prompt": "x"})
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"


def test_healthz_is_open(secured: RunningServer) -> None:
    assert httpx.get(secured.base_url + "/healthz").status_code == 200


def test_openai_client_with_the_key(secured: RunningServer) -> None:
    api = openai.OpenAI(base_url=secured.v1, api_key=KEY, max_retries=0)
    out = api.completions.create(model=TINY_NAME, prompt="Hello", max_tokens=2, temperature=0)
    assert out.choices[0].text is not None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=secured.v1, api_key="nope", max_retries=0).models.list()


def test_bearer_comparison() -> None:
    assert bearer_matches(f"Bearer {KEY}".encode(), KEY)
    assert bearer_matches(f"bearer  {KEY}".encode(), KEY)
    assert not bearer_matches(None, KEY)
    assert not bearer_matches(f"Bearer {KEY}x".encode(), KEY)
    assert not bearer_matches(b"Bearer", KEY)


def test_published_schema_requires_the_key_and_declares_it(secured: RunningServer) -> None:
    assert httpx.get(secured.base_url + "/openapi.json").status_code == 401
    schema = httpx.get(secured.base_url + "/openapi.json", headers=secured.headers()).json()
    assert schema["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    assert schema["security"] == [{"bearer": []}]
