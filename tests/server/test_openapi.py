"""/openapi.json documents every endpoint's request body and responses; /docs renders it."""

from __future__ import annotations

import httpx
import jsonschema

from tests.server.harness import TINY_NAME, RunningServer

BODY_ENDPOINTS = {
    "/v1/completions": "CompletionRequest",
    "/v1/chat/completions": "ChatCompletionRequest",
    "/generate": "GenerateRequest",
}


def schema_of(server: RunningServer) -> dict:  # type: ignore[type-arg]
    response = httpx.get(server.base_url + "/openapi.json", timeout=30)
    assert response.status_code == 200
    return response.json()  # type: ignore[no-any-return]


def test_every_endpoint_documents_its_request_and_responses(tiny_server: RunningServer) -> None:
    schema = schema_of(tiny_server)
    paths = schema["paths"]
    assert set(paths) == {
        "/v1/completions",
        "/v1/chat/completions",
        "/generate",
        "/v1/models",
        "/flush_cache",
        "/update_weights",
        "/reset_prefix_cache",
        "/healthz",
        "/metrics",
    }
    for path, model in BODY_ENDPOINTS.items():
        operation = paths[path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        responses = operation["responses"]
        assert {"200", "400", "429", "500", "503"} <= set(responses)
        assert "422" not in responses  # bad bodies are OpenAI-style 400s
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        error = responses["400"]["content"]["application/json"]["schema"]
        assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    for path in ("/v1/models", "/healthz"):
        assert "application/json" in paths[path]["get"]["responses"]["200"]["content"]
    assert "HTTPValidationError" not in schema["components"]["schemas"]


def test_real_responses_validate_against_the_published_schema(tiny_server: RunningServer) -> None:
    schema = schema_of(tiny_server)
    components = {"components": schema["components"]}

    def check(path: str, status: int, document: object) -> None:
        method = "get" if path in ("/v1/models", "/healthz") else "post"
        declared = schema["paths"][path][method]["responses"][str(status)]["content"]["application/json"]
        jsonschema.validate(document, {**declared["schema"], **components})

    completion = {"model": TINY_NAME, "prompt": "Hi", "max_tokens": 3, "logprobs": 2, "echo": True, "n": 2}
    chat = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "logprobs": True,
        "top_logprobs": 1,
    }
    generate = {"text": ["Hi", "Yo"], "sampling_params": {"max_new_tokens": 3}, "return_logprob": True}
    for path, body in (
        ("/v1/completions", completion),
        ("/v1/chat/completions", chat),
        ("/generate", generate),
    ):
        response = httpx.post(tiny_server.base_url + path, json=body, timeout=60)
        check(path, 200, response.json())
        bad = httpx.post(tiny_server.base_url + path, json={"n": "x"}, timeout=60)
        check(path, bad.status_code, bad.json())
    check("/v1/models", 200, httpx.get(tiny_server.base_url + "/v1/models").json())
    check("/healthz", 200, httpx.get(tiny_server.base_url + "/healthz").json())


def test_docs_page_is_served(tiny_server: RunningServer) -> None:
    page = httpx.get(tiny_server.base_url + "/docs", timeout=30)
    assert page.status_code == 200 and "openapi.json" in page.text
