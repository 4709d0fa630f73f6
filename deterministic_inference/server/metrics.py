"""Prometheus metrics in the text exposition format (version 0.0.4), written without a client library.

Counters and histograms are updated from the event loop only (single thread, no locks needed); the
engine gauges come from the snapshot the engine thread publishes after each step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
PREFIX = "detinf"


class Histogram:
    """Cumulative-bucket histogram of seconds."""

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Add one observation."""
        self.total += 1
        self.sum += value
        for index, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[index] += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        """Exposition lines (_bucket, _sum, _count)."""
        sep = "," if labels else ""
        out = [
            f'{name}_bucket{{{labels}{sep}le="{_num(b)}"}} {c}'
            for b, c in zip(self.buckets, self.counts, strict=True)
        ]
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.total}')
        suffix = f"{{{labels}}}" if labels else ""
        out.append(f"{name}_sum{suffix} {_num(self.sum)}")
        out.append(f"{name}_count{suffix} {self.total}")
        return out


class ServerMetrics:
    """Request counters by endpoint and status, token counters, latency histograms."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = {}  # (path, status) -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.aborted_requests = 0
        self.time_to_first_token = Histogram()
        self.request_latency = Histogram()

    def count_request(self, path: str, status: int) -> None:
        """One HTTP request answered with `status`."""
        key = (path, status)
        self.requests[key] = self.requests.get(key, 0) + 1

    def observe_finished(self, prompt_tokens: int, generation_tokens: int, latency: float) -> None:
        """One engine request finished."""
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens
        self.request_latency.observe(latency)

    def render(self, engine_stats: dict[str, Any], ready: bool) -> str:
        """The whole exposition text."""
        lines: list[str] = []
        _metric(
            lines,
            "requests_total",
            "counter",
            "HTTP requests by path and status code",
            ((f'path="{_esc(p)}",status="{s}"', v) for (p, s), v in sorted(self.requests.items())),
        )
        _metric(
            lines,
            "prompt_tokens_total",
            "counter",
            "prompt tokens of finished requests",
            [("", self.prompt_tokens)],
        )
        _metric(
            lines,
            "generation_tokens_total",
            "counter",
            "generated tokens of finished requests",
            [("", self.generation_tokens)],
        )
        _metric(
            lines,
            "aborted_requests_total",
            "counter",
            "requests aborted (client gone)",
            [("", self.aborted_requests)],
        )
        _histogram(
            lines,
            "time_to_first_token_seconds",
            "time from arrival to the first token",
            self.time_to_first_token,
        )
        _histogram(
            lines, "request_latency_seconds", "time from arrival to the last token", self.request_latency
        )
        cache = engine_stats.get("prefix_cache", {})
        gauges = [
            ("ready", "1 when the engine serves requests", int(ready)),
            ("num_requests_waiting", "sequences waiting in the engine", engine_stats.get("num_waiting", 0)),
            ("num_requests_running", "sequences running in the engine", engine_stats.get("num_running", 0)),
            (
                "num_inflight_sequences",
                "sequences admitted by the server and not finished",
                engine_stats.get("num_inflight_sequences", 0),
            ),
            ("kv_blocks_used", "KV-cache blocks held by requests", engine_stats.get("kv_blocks_used", 0)),
            ("kv_blocks_total", "KV-cache blocks in the pool", engine_stats.get("kv_blocks_total", 0)),
        ]
        for name, help_text, value in gauges:
            _metric(lines, name, "gauge", help_text, [("", value)])
        for key in ("queries", "queried_tokens", "hit_tokens", "evictions"):
            _metric(
                lines,
                f"prefix_cache_{key}_total",
                "counter",
                f"prefix cache {key.replace('_', ' ')}",
                [("", cache.get(key, 0))],
            )
        return "\n".join(lines) + "\n"


def _metric(
    lines: list[str], name: str, kind: str, help_text: str, samples: Iterable[tuple[str, float]]
) -> None:
    full = f"{PREFIX}_{name}"
    lines.append(f"# HELP {full} {help_text}")
    lines.append(f"# TYPE {full} {kind}")
    for labels, value in samples:
        lines.append(f"{full}{{{labels}}} {_num(value)}" if labels else f"{full} {_num(value)}")


def _histogram(lines: list[str], name: str, help_text: str, histogram: Histogram) -> None:
    full = f"{PREFIX}_{name}"
    lines.append(f"# HELP {full} {help_text}")
    lines.append(f"# TYPE {full} histogram")
    lines.extend(histogram.lines(full))


def _num(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _esc(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
