"""Prometheus metrics through `prometheus_client`, in a registry owned by each app (no global state).

Where a metric means what vLLM's does, it has vLLM's name and its ``model_name`` label, so dashboards
and alerts written for vLLM work unchanged:

    vllm:num_requests_running, vllm:num_requests_waiting      gauges: sequences in the engine
    vllm:kv_cache_usage_perc                                  gauge: KV blocks in use / pool (0..1)
    vllm:prompt_tokens_total, vllm:generation_tokens_total    counters (finished requests)
    vllm:request_success_total{finished_reason}               counter: finished requests by reason
    vllm:time_to_first_token_seconds                          histogram
    vllm:e2e_request_latency_seconds                          histogram
    vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total   counters, in tokens
    vllm:num_preemptions_total                                counter
    vllm:spec_decode_num_drafts_total, vllm:spec_decode_num_draft_tokens_total,
    vllm:spec_decode_num_accepted_tokens_total, vllm:spec_decode_num_emitted_tokens_total,
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position}   counters: speculative decoding

Ours (``detinf_``): HTTP requests by path and status, aborted requests, readiness, admitted sequences,
KV blocks, prefix-cache admissions and evictions, the invariance mode (``detinf_batch_invariant``), the
start-up self-check (``detinf_selfcheck_info{status}``, ``detinf_selfcheck_probes``), the acceptance
length of drafted steps (``detinf_spec_decode_acceptance_length``, a histogram: draft tokens accepted per
verified step, 0..K) and the fingerprint (``detinf_fingerprint_info{system_fingerprint, model_name}``).

Request counters and histograms are updated from the event loop; engine values are read at scrape
time from the snapshot the engine thread publishes after each step (a collector, not stored twice).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
MODEL_LABEL = "model_name"


class ServerMetrics:
    """The server's metrics. `model_name` gives the served model's name (None until the engine is
    loaded); `engine_stats` and `ready` read the engine's latest snapshot at scrape time."""

    def __init__(
        self,
        model_name: Callable[[], str | None],
        engine_stats: Callable[[], dict[str, Any]],
        ready: Callable[[], bool],
        fingerprint: Callable[[], str | None],
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._model_name = model_name
        registry = self.registry
        self.requests = Counter("detinf_requests", "HTTP requests by path and status code",
                                ("path", "status"), registry=registry)
        self.aborted = Counter("detinf_aborted_requests", "requests aborted (client gone)", registry=registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "prompt tokens of finished requests",
                                     (MODEL_LABEL,), registry=registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "generated tokens of finished requests",
                                         (MODEL_LABEL,), registry=registry)
        self.success = Counter("vllm:request_success", "finished requests by finish reason",
                               (MODEL_LABEL, "finished_reason"), registry=registry)
        self.time_to_first_token = Histogram("vllm:time_to_first_token_seconds",
                                             "time from arrival to the first token", (MODEL_LABEL,),
                                             buckets=LATENCY_BUCKETS, registry=registry)
        self.latency = Histogram("vllm:e2e_request_latency_seconds", "time from arrival to the last token",
                                 (MODEL_LABEL,), buckets=LATENCY_BUCKETS, registry=registry)
        registry.register(_EngineCollector(model_name, engine_stats, ready, fingerprint))

    def count_request(self, path: str, status: int) -> None:
        """One HTTP request answered with `status`."""
        self.requests.labels(path=path, status=str(status)).inc()

    def count_aborted(self) -> None:
        """One request aborted because its client went away."""
        self.aborted.inc()

    def observe_first_token(self, seconds: float) -> None:
        """Time to the first token of one request."""
        self.time_to_first_token.labels(self._model()).observe(seconds)

    def observe_finished(
        self, prompt_tokens: int, generation_tokens: int, latency: float, finish_reasons: Sequence[str | None]
    ) -> None:
        """One engine request finished (its choices' finish reasons)."""
        model = self._model()
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.generation_tokens.labels(model).inc(generation_tokens)
        self.latency.labels(model).observe(latency)
        for reason in finish_reasons:
            self.success.labels(model, reason or "unknown").inc()

    def render(self) -> bytes:
        """The exposition text (format 0.0.4)."""
        return bytes(generate_latest(self.registry))

    def _model(self) -> str:
        return self._model_name() or ""


class _EngineCollector(Collector):
    """Engine gauges and counters from the engine's latest snapshot, read at each scrape."""

    def __init__(
        self,
        model_name: Callable[[], str | None],
        engine_stats: Callable[[], dict[str, Any]],
        ready: Callable[[], bool],
        fingerprint: Callable[[], str | None],
    ) -> None:
        self.model_name = model_name
        self.engine_stats = engine_stats
        self.ready = ready
        self.fingerprint = fingerprint

    def collect(self) -> Iterator[Metric]:
        stats, model = self.engine_stats(), self.model_name() or ""
        cache = stats.get("prefix_cache", {})
        used, total = stats.get("kv_blocks_used", 0), stats.get("kv_blocks_total", 0)
        yield _gauge("vllm:num_requests_running", "sequences running in the engine",
                     stats.get("num_running", 0), model)
        yield _gauge("vllm:num_requests_waiting", "sequences waiting in the engine",
                     stats.get("num_waiting", 0), model)
        yield _gauge("vllm:kv_cache_usage_perc", "KV-cache usage: blocks in use / pool (1 = full)",
                     used / total if total else 0.0, model)
        yield _counter("vllm:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                       cache.get("queried_tokens", 0), model)
        yield _counter("vllm:prefix_cache_hits", "prompt tokens served from the prefix cache",
                       cache.get("hit_tokens", 0), model)
        yield _counter("vllm:num_preemptions", "sequences preempted (recomputed later)",
                       stats.get("num_preemptions", 0), model)
        yield from _spec_decode(stats.get("spec_decode") or {}, model)
        yield from self._own(stats, cache, used, total, model)

    def _own(self, stats: dict[str, Any], cache: dict[str, Any], used: int, total: int,
             model: str) -> Iterator[Metric]:
        yield _gauge("detinf_ready", "1 when the engine serves requests", int(self.ready()))
        yield _gauge("detinf_num_inflight_sequences", "sequences admitted by the server and not finished",
                     stats.get("num_inflight_sequences", 0))
        yield _gauge("detinf_kv_blocks_used", "KV-cache blocks held by requests", used)
        yield _gauge("detinf_kv_blocks_total", "KV-cache blocks in the pool", total)
        for key, text in (("queries", "admissions that looked up the prefix cache"),
                          ("queried_tokens", "prompt tokens looked up in the prefix cache"),
                          ("hit_tokens", "prompt tokens served from the prefix cache"),
                          ("evictions", "cached blocks evicted to reuse them")):
            yield _counter(f"detinf_prefix_cache_{key}", text, cache.get(key, 0))
        if "batch_invariant" in stats:
            yield _gauge("detinf_batch_invariant", "1 when batch-invariant (reproducible) ops run, 0 for "
                         "plain torch ops", int(bool(stats["batch_invariant"])))
            check = stats.get("selfcheck")
            status = "skipped" if check is None else ("passed" if check["passed"] else "failed")
            info = GaugeMetricFamily("detinf_selfcheck_info", "the start-up invariance self-check's outcome",
                                     labels=("status",))
            info.add_metric((status,), 1)
            yield info
            yield _gauge("detinf_selfcheck_probes", "op probes the start-up self-check ran",
                         0 if check is None else check["probes"])
        fingerprint = self.fingerprint()
        if fingerprint is not None:
            info = GaugeMetricFamily("detinf_fingerprint_info", "the engine's system_fingerprint (label)",
                                     labels=("system_fingerprint", MODEL_LABEL))
            info.add_metric((fingerprint, model), 1)
            yield info


def _spec_decode(spec: dict[str, Any], model: str) -> Iterator[Metric]:
    """Speculative decoding counters (vLLM's names) and our acceptance-length histogram."""
    for key, text in (("num_drafts", "drafted steps verified"),
                      ("num_draft_tokens", "draft tokens scored by the target"),
                      ("num_accepted_tokens", "draft tokens equal to the token chosen at their position"),
                      ("num_emitted_tokens", "tokens emitted by drafted steps")):
        yield _counter(f"vllm:spec_decode_{key}", text, spec.get(key, 0), model)
    per_position = spec.get("accepted_per_position") or []
    family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                 "accepted draft tokens by draft position", labels=(MODEL_LABEL, "position"))
    for position, count in enumerate(per_position):
        family.add_metric((model, str(position)), count)
    yield family
    lengths = spec.get("acceptance_lengths") or []
    histogram = HistogramMetricFamily("detinf_spec_decode_acceptance_length",
                                      "draft tokens accepted per verified drafted step",
                                      labels=(MODEL_LABEL,))
    cumulative, buckets = 0, []
    for accepted, count in enumerate(lengths):
        cumulative += count
        buckets.append((str(float(accepted)), cumulative))
    buckets.append(("+Inf", cumulative))
    histogram.add_metric((model,), buckets, sum_value=float(spec.get("num_accepted_tokens", 0)))
    yield histogram


_Family = TypeVar("_Family", GaugeMetricFamily, CounterMetricFamily)


def _family(kind: type[_Family], name: str, text: str, value: float, model: str | None = None) -> _Family:
    """One sample of a gauge or counter, labelled with the served model name when given."""
    if model is None:
        return kind(name, text, value=value)
    family = kind(name, text, labels=(MODEL_LABEL,))
    family.add_metric((model,), value)
    return family


_gauge = functools.partial(_family, GaugeMetricFamily)
_counter = functools.partial(_family, CounterMetricFamily)
