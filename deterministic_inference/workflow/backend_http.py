"""Run a manifest's requests against any OpenAI-compatible endpoint (``--base-url``) over HTTP.

Completion requests go to ``/v1/completions`` and chat requests to ``/v1/chat/completions``, in dataset
order, ``inference.batching.concurrency`` at a time. Token ids are taken from the response when the server
returns them (vLLM's ``return_token_ids`` fields ``token_ids`` / ``prompt_token_ids``, or tokens written as
``token_id:N`` when ``return_tokens_as_token_ids`` is honoured); otherwise the token strings are recorded
in ``output_tokens`` and a warning says ids were unavailable. Logprobs are recorded exactly as parsed from
the JSON. The endpoint's hardware is unknown to the client: the fingerprint records the endpoint's
``system_fingerprint`` values as its software part and a fixed "remote" hardware part.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from deterministic_inference import fingerprint
from deterministic_inference.errors import WorkflowError
from deterministic_inference.workflow.backend_engine import BackendResult
from deterministic_inference.workflow.constraints import CONSTRAINT_FIELDS

_TOKEN_ID = re.compile(r"^token_id:(\d+)$")


def run_http(manifest: dict[str, Any], base_url: str, requests: list[dict[str, Any]]) -> BackendResult:
    """Send every request to the endpoint and collect the sequences."""
    execution = manifest["runtime"]["execution"]
    captures = manifest["capture"]
    top_k = captures["logits"]["top_k"] if captures["logits"]["enabled"] else 0
    started = time.perf_counter()
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    warnings: list[str] = []
    with httpx.Client(base_url=root, timeout=float(execution["timeout_seconds"]), trust_env=False) as client:
        wanted = execution.get("model") or manifest["model"]["source"].get("name")
        model = _served_model(client, wanted, warnings)
        workers = max(1, int(manifest["inference"]["batching"]["concurrency"]))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            responses = list(pool.map(lambda r: _post(client, r, model, top_k), requests))
    finished = time.perf_counter()
    sequences: list[dict[str, Any]] = []
    fingerprints: set[str] = set()
    for request, response in zip(requests, responses, strict=True):
        if isinstance(response.get("system_fingerprint"), str):
            fingerprints.add(response["system_fingerprint"])
        sequences.extend(_sequences(request, response, warnings))
    remote = {"endpoint_model": model, "system_fingerprints": sorted(fingerprints)}
    fp = {"model": f"remote:{model}", "numerics": None, "software": fingerprint.digest(remote),
          "hardware": fingerprint.digest({"remote": "hardware of the endpoint is not visible to the client"})}
    return BackendResult(
        backend="openai_compatible", sequences=sequences, fingerprint=fp,
        system_fingerprint=",".join(sorted(fingerprints)) or "unknown",
        batch_trace=[{"concurrency": workers, "request_order": [r["request_id"] for r in requests]}],
        timings={"load_seconds": 0.0, "generate_seconds": finished - started}, warnings=warnings,
    )


def _served_model(client: httpx.Client, wanted: str | None, warnings: list[str]) -> str:
    """The model name to send: the manifest's if the endpoint serves it, else the endpoint's first model."""
    try:
        listing = client.get("/v1/models")
        listing.raise_for_status()
        served = [str(item.get("id")) for item in listing.json().get("data", []) if isinstance(item, dict)]
    except (httpx.HTTPError, ValueError) as error:
        raise WorkflowError(f"{client.base_url}: cannot list models ({error}); check --base-url") from None
    if wanted and wanted in served:
        return wanted
    if not served:
        raise WorkflowError(f"{client.base_url}/v1/models lists no model; start the server with a model")
    if wanted and wanted != "default":
        warnings.append(f"endpoint does not serve {wanted!r}; using its model {served[0]!r}")
    return served[0]


def _post(client: httpx.Client, request: dict[str, Any], model: str, top_k: int) -> dict[str, Any]:
    body = _body(request, model, top_k)
    path = "/v1/chat/completions" if request["kind"] == "chat" else "/v1/completions"
    try:
        response = client.post(path, json=body)
    except httpx.HTTPError as error:
        raise WorkflowError(f"{client.base_url}{path}: request {request['request_id']} failed: "
                            f"{error}") from None
    if response.status_code != 200:
        raise WorkflowError(
            f"{client.base_url}{path}: request {request['request_id']} got HTTP {response.status_code}: "
            f"{response.text[:300]}"
        )
    document: dict[str, Any] = response.json()
    return document


def _body(request: dict[str, Any], model: str, top_k: int) -> dict[str, Any]:
    sampling = request["sampling"]
    body: dict[str, Any] = {
        "model": model, "max_tokens": sampling["max_tokens"], "temperature": sampling["temperature"],
        "top_p": sampling["top_p"], "n": sampling["n"], "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    optional = {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                "frequency_penalty": 0.0, "ignore_eos": False, "seed": None}
    for name, default in optional.items():
        if sampling[name] != default:
            body[name] = sampling[name]
    if request["stop"].get("sequences"):
        body["stop"] = list(request["stop"]["sequences"])
    if request["stop"].get("token_ids"):
        body["stop_token_ids"] = list(request["stop"]["token_ids"])
    if request["kind"] == "chat":
        body.update(messages=request["messages"], logprobs=True, top_logprobs=top_k)
    else:
        body.update(prompt=request["prompt"], logprobs=top_k)
    body.update({name: request[name] for name in CONSTRAINT_FIELDS if name in request})
    return body


def _sequences(
    request: dict[str, Any], response: dict[str, Any], warnings: list[str]
) -> list[dict[str, Any]]:
    choices = sorted(response.get("choices") or [], key=lambda choice: int(choice.get("index", 0)))
    if not choices:
        raise WorkflowError(f"request {request['request_id']}: the endpoint returned no choices")
    entries = []
    for choice in choices:
        tokens, logprobs, tops = _choice_logprobs(choice)
        ids = choice.get("token_ids")
        if not isinstance(ids, list):
            keys = [_token_key(token) for token in tokens]
            ids = keys if keys and all(isinstance(key, int) for key in keys) else None
        prompt_ids = choice.get("prompt_token_ids") or response.get("prompt_token_ids") or []
        entry: dict[str, Any] = {
            "request_id": request["request_id"], "index": int(choice.get("index", 0)),
            "prompt_token_ids": list(prompt_ids),
            "output_token_ids": list(ids or []), "text": _choice_text(choice),
            "finish_reason": choice.get("finish_reason"), "token_logprobs": logprobs, "top_logprobs": tops,
        }
        if ids is None:
            entry["output_tokens"] = tokens
            message = "endpoint returned no token ids; token strings and text are compared instead"
            if message not in warnings:
                warnings.append(message)
        entries.append(entry)
    return entries


def _choice_text(choice: dict[str, Any]) -> str:
    if isinstance(choice.get("message"), dict):
        return str(choice["message"].get("content") or "")
    return str(choice.get("text") or "")


def _choice_logprobs(choice: dict[str, Any]) -> tuple[list[str], list[float], list[list[list[Any]]]]:
    block = choice.get("logprobs")
    if not isinstance(block, dict):
        return [], [], []
    if isinstance(block.get("content"), list):  # chat format
        tokens = [str(item.get("token")) for item in block["content"]]
        values = [float(item.get("logprob")) for item in block["content"]]
        tops = [[[_token_key(alt.get("token")), float(alt.get("logprob"))]
                 for alt in item.get("top_logprobs") or []] for item in block["content"]]
        return tokens, values, tops
    tokens = [str(token) for token in block.get("tokens") or []]
    values = [float(value) for value in block.get("token_logprobs") or [] if value is not None]
    tops = [[[_token_key(token), float(value)] for token, value in (step or {}).items()]
            for step in block.get("top_logprobs") or []]
    return tokens, values, tops


def _token_key(token: Any) -> Any:
    match = _TOKEN_ID.match(str(token))
    return int(match.group(1)) if match else str(token)
