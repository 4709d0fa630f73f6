"""HTTP client of the audit: OpenAI completions/chat on any compatible server, reduced to `Sample`s.

A sample is what a client can compare between two responses: the text, the finish reason and, when
the server returns them, every token's text, logprob and top alternatives. Two samples are the same
output iff their canonical JSON is byte-identical (floats written with repr, so one differing logprob
bit makes a different sample).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import httpx

from deterministic_inference.errors import DetinfError

MAX_RETRIES_429 = 20
RESET_PATHS = ("/flush_cache", "/reset_prefix_cache")  # SGLang's (and detinf's), vLLM's


class AuditError(DetinfError):
    """The audit could not run (server unreachable, a request failed, unusable answers)."""


@dataclass(frozen=True)
class Sample:
    """One response reduced to the parts that must be reproducible."""

    text: str
    finish_reason: str | None
    tokens: list[Any] = field(default_factory=list)  # per token: [text, logprob, [[alt, logprob], ...]]
    prompt_tokens: list[Any] = field(default_factory=list)  # echoed prompt tokens (scoring), same shape
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (not compared)
    prompt_token_count: int | None = None  # usage.prompt_tokens (not compared)
    system_fingerprint: str | None = None  # not compared

    def canonical(self) -> str:
        """The compared content as canonical JSON."""
        content = {
            "text": self.text,
            "finish_reason": self.finish_reason,
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
        }
        return json.dumps(content, sort_keys=True, ensure_ascii=False, separators=(",", ":"))

    @property
    def digest(self) -> str:
        """sha256 of the canonical JSON."""
        return hashlib.sha256(self.canonical().encode()).hexdigest()


@dataclass(frozen=True)
class Endpoint:
    """Where and how to reach the server."""

    base_url: str  # as given: http://host:port or http://host:port/v1
    api_key: str | None = None
    model: str | None = None
    chat: bool = False  # use /chat/completions instead of /completions
    logprobs: bool = True  # ask for logprobs (1 alternative) and compare them
    timeout: float = 600.0

    @property
    def api_base(self) -> str:
        """The OpenAI base URL (ending in /v1)."""
        url = self.base_url.rstrip("/")
        return url if url.endswith("/v1") else url + "/v1"

    @property
    def root(self) -> str:
        """The server root (for /flush_cache)."""
        return self.api_base[: -len("/v1")]


class AuditClient:
    """Async client for one endpoint; use as `async with AuditClient(endpoint, concurrency) as c`."""

    def __init__(self, endpoint: Endpoint, concurrency: int) -> None:
        self.endpoint = endpoint
        headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
        limits = httpx.Limits(
            max_connections=max(concurrency, 1) + 4, max_keepalive_connections=max(concurrency, 1)
        )
        self._http = httpx.AsyncClient(headers=headers, timeout=endpoint.timeout, limits=limits)
        self.model = endpoint.model or ""
        self.max_model_len: int | None = None
        self._reset_path: str | None = None  # the prefix-cache reset endpoint that answered

    async def __aenter__(self) -> AuditClient:
        await self._discover()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def _discover(self) -> None:
        """Read the model name (unless given) and its context length from GET /v1/models."""
        try:
            response = await self._http.get(self.endpoint.api_base + "/models")
        except httpx.HTTPError as error:
            raise AuditError(f"cannot reach {self.endpoint.api_base}: {error}") from None
        if response.status_code != 200:
            if self.model:
                return
            raise AuditError(f"GET /v1/models answered {response.status_code}; pass --model")
        cards = response.json().get("data") or []
        card = next((c for c in cards if c.get("id") == self.model), cards[0] if cards else None)
        if card is None:
            raise AuditError("GET /v1/models lists no model; pass --model")
        self.model = self.model or str(card["id"])
        max_len = card.get("max_model_len")
        self.max_model_len = int(max_len) if isinstance(max_len, int) else None

    async def generate(
        self,
        prompt: str,
        max_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        json_schema: dict[str, Any] | None = None,
    ) -> Sample:
        """One completion (or chat turn with `prompt` as the user message); with `json_schema`, the
        output is constrained to it (chat: OpenAI `response_format`; completions: vLLM's
        `structured_outputs`, which detinf serves too)."""
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "seed": seed,
        }
        if json_schema is not None and self.endpoint.chat:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "audit", "schema": json_schema},
            }
        elif json_schema is not None:
            body["structured_outputs"] = {"json": json_schema}
        if self.endpoint.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
            if self.endpoint.logprobs:
                body.update(logprobs=True, top_logprobs=1)
            return chat_sample(await self._post("/chat/completions", body))
        body["prompt"] = prompt
        if self.endpoint.logprobs:
            body["logprobs"] = 1
        return completion_sample(await self._post("/completions", body), echoed=False)

    async def score(self, prompt: str) -> Sample:
        """Prompt logprobs of `prompt` (echo=True, logprobs=1, one greedy token): a scoring request."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0.0,
            "echo": True,
            "logprobs": 1,
        }
        return completion_sample(await self._post("/completions", body), echoed=True)

    async def generate_ids(
        self, prompt: str, max_tokens: int
    ) -> tuple[list[int], list[int], list[Any]] | None:
        """Greedy completion as (prompt ids, output ids, output logprobs), through vLLM's (and detinf's)
        `return_token_ids`; None when the server returns no ids."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "logprobs": 0, "return_token_ids": True}
        choice = (await self._post("/completions", body))["choices"][0]
        prompt_ids, ids = choice.get("prompt_token_ids"), choice.get("token_ids")
        if not isinstance(prompt_ids, list) or not isinstance(ids, list):
            return None
        return prompt_ids, ids, list((choice.get("logprobs") or {}).get("token_logprobs") or [])

    async def score_ids(self, ids: list[int]) -> list[Any]:
        """Prompt logprobs of the token ids `ids` (echo, one greedy token after them)."""
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "echo": True,
                "logprobs": 0}
        choice = (await self._post("/completions", body))["choices"][0]
        return list((choice.get("logprobs") or {}).get("token_logprobs") or [])[: len(ids)]

    async def flush_cache(self) -> bool:
        """Empty the server's prefix cache through whichever endpoint it has: SGLang's (and detinf's)
        POST /flush_cache, else vLLM's POST /reset_prefix_cache. False when it has neither; the endpoint
        that answered is remembered for the next call."""
        paths = [self._reset_path] if self._reset_path else list(RESET_PATHS)
        for path in paths:
            try:
                response = await self._http.post(self.endpoint.root + path)
            except httpx.HTTPError as error:
                raise AuditError(f"POST {path} failed: {error}") from None
            if response.status_code in (404, 405):
                continue
            if response.status_code >= 400:
                raise AuditError(f"POST {path} answered {response.status_code}: {response.text[:300]}")
            self._reset_path = path
            return True
        return False

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        for _ in range(MAX_RETRIES_429):
            try:
                response = await self._http.post(self.endpoint.api_base + path, json=body)
            except httpx.HTTPError as error:
                raise AuditError(f"POST {path} failed: {type(error).__name__}: {error}") from None
            if response.status_code == 429:
                await asyncio.sleep(_retry_after(response))
                continue
            if response.status_code != 200:
                raise AuditError(f"POST {path} answered {response.status_code}: {response.text[:300]}")
            data = response.json()
            if not isinstance(data, dict) or not data.get("choices"):
                raise AuditError(f"POST {path} answered without choices: {response.text[:300]}")
            return data
        raise AuditError(f"POST {path}: still 429 after {MAX_RETRIES_429} retries")


def _retry_after(response: httpx.Response) -> float:
    try:
        return min(max(float(response.headers.get("Retry-After", "1")), 0.05), 10.0)
    except ValueError:
        return 1.0


def _meta(data: dict[str, Any]) -> dict[str, Any]:
    """The non-compared fields of a Sample, from usage and the fingerprint."""
    usage = data.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    prompt_tokens = usage.get("prompt_tokens")
    return {
        "cached_tokens": cached if isinstance(cached, int) else None,
        "prompt_token_count": prompt_tokens if isinstance(prompt_tokens, int) else None,
        "system_fingerprint": data.get("system_fingerprint"),
    }


def completion_sample(data: dict[str, Any], echoed: bool) -> Sample:
    """Sample of a /v1/completions response (choice 0); with `echoed`, prompt tokens are split off."""
    choice = data["choices"][0]
    logprobs = choice.get("logprobs") or {}
    tokens = [
        [text, value, sorted([alt, lp] for alt, lp in (top or {}).items())]
        for text, value, top in zip(
            logprobs.get("tokens") or [],
            logprobs.get("token_logprobs") or [],
            logprobs.get("top_logprobs") or [],
            strict=False,
        )
    ]
    prompt_tokens: list[Any] = []
    if echoed:
        completion_tokens = (data.get("usage") or {}).get("completion_tokens", 1)
        split = max(len(tokens) - int(completion_tokens), 0)
        prompt_tokens, tokens = tokens[:split], tokens[split:]
    return Sample(choice.get("text") or "", choice.get("finish_reason"), tokens, prompt_tokens, **_meta(data))


def chat_sample(data: dict[str, Any]) -> Sample:
    """Sample of a /v1/chat/completions response (choice 0)."""
    choice = data["choices"][0]
    content = (choice.get("logprobs") or {}).get("content") or []
    tokens = [
        [
            entry.get("token"),
            entry.get("logprob"),
            [[t.get("token"), t.get("logprob")] for t in entry.get("top_logprobs") or []],
        ]
        for entry in content
    ]
    text = (choice.get("message") or {}).get("content") or ""
    return Sample(text, choice.get("finish_reason"), tokens, [], **_meta(data))
