"""GET /metrics through prometheus_client, read back with prometheus_client's own parser: vLLM's names
and `model_name` label where the meaning is the same, and our own (fingerprint, self-check, invariance
mode, prefix cache, HTTP requests)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from deterministic_inference.server.app import ServerSettings
from tests.server.harness import TINY_NAME, RunningServer, thread_server, tiny_config
from tests.tiny_models import TinyModel

VLLM_FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
}


def scrape(server: RunningServer) -> dict[str, tuple[str, list[Sample]]]:
    """family name -> (type, samples), parsed by prometheus_client."""
    response = httpx.get(server.base_url + "/metrics", timeout=30)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {f.name: (f.type, list(f.samples)) for f in text_string_to_metric_families(response.text)}


def value(families: dict[str, tuple[str, list[Sample]]], sample_name: str, **labels: str) -> float:
    """The value of the one sample with this name and (at least) these labels."""
    found = [s.value for _, samples in families.values() for s in samples
             if s.name == sample_name and labels.items() <= s.labels.items()]
    assert len(found) == 1, (sample_name, labels, found)
    return float(found[0])


def total(families: dict[str, tuple[str, list[Sample]]], sample_name: str) -> float:
    """Sum of the samples with this name (0 before a labelled counter has its first child)."""
    return float(sum(s.value for _, samples in families.values() for s in samples if s.name == sample_name))


@pytest.fixture(scope="module")
def plain_server(tiny_llama_dir: TinyModel) -> Iterator[RunningServer]:
    config = tiny_config(tiny_llama_dir, batch_invariant=False)
    with thread_server(config, ServerSettings(served_model_name=TINY_NAME)) as server:
        yield server


def test_vllm_names_and_labels(tiny_server: RunningServer) -> None:
    before = scrape(tiny_server)
    body = {"model": TINY_NAME, "prompt": "Metrics " + "prefix " * 20, "max_tokens": 5, "temperature": 0}
    for _ in range(2):  # the second one hits the prefix cache
        done = httpx.post(tiny_server.v1 + "/completions", json=body, timeout=60).json()
    after = scrape(tiny_server)
    for name, kind in VLLM_FAMILIES.items():
        assert after[name][0] == kind, name
        assert all(s.labels.get("model_name") == TINY_NAME for s in after[name][1]), name
    generated = 2 * done["usage"]["completion_tokens"]
    delta = (value(after, "vllm:generation_tokens_total", model_name=TINY_NAME)
             - total(before, "vllm:generation_tokens_total"))
    assert delta == generated
    assert value(after, "vllm:request_success_total", finished_reason="length") >= 2
    hits = value(after, "vllm:prefix_cache_hits_total") - value(before, "vllm:prefix_cache_hits_total")
    assert hits >= done["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert value(after, "vllm:prefix_cache_queries_total") >= value(after, "vllm:prefix_cache_hits_total")
    assert 0.0 <= value(after, "vllm:kv_cache_usage_perc") <= 1.0
    assert value(after, "vllm:e2e_request_latency_seconds_count") >= 2
    assert value(after, "vllm:time_to_first_token_seconds_bucket", le="+Inf") >= 2


def test_our_metrics_fingerprint_selfcheck_invariance(tiny_server: RunningServer) -> None:
    families = scrape(tiny_server)
    fingerprint = httpx.get(tiny_server.base_url + "/healthz", timeout=10).json()["system_fingerprint"]
    labels = {"system_fingerprint": fingerprint, "model_name": TINY_NAME}
    assert value(families, "detinf_fingerprint_info", **labels) == 1
    assert value(families, "detinf_batch_invariant") == 1
    assert value(families, "detinf_selfcheck_info", status="passed") == 1
    assert value(families, "detinf_selfcheck_probes") > 0
    assert value(families, "detinf_ready") == 1
    assert value(families, "detinf_requests_total", path="/healthz", status="200") >= 1
    for name in ("detinf_kv_blocks_used", "detinf_kv_blocks_total", "detinf_num_inflight_sequences",
                 "detinf_prefix_cache_hit_tokens_total", "detinf_prefix_cache_evictions_total",
                 "detinf_aborted_requests_total"):
        value(families, name)


def test_plain_ops_server_says_so(plain_server: RunningServer) -> None:
    families = scrape(plain_server)
    assert value(families, "detinf_batch_invariant") == 0
    assert value(families, "detinf_selfcheck_info", status="skipped") == 1
