"""Determinism audit of any OpenAI-compatible endpoint (`detinf audit`)."""

# What an audit can vary (audit/modes.py runs each). Kept here, apart from the HTTP client, so that
# registering the `audit` command does not import httpx (and the rich / pygments it pulls in): every
# `detinf` command registers it, `serve` included (6 MB of resident memory).
MODES = ("single", "mixed", "prefix", "radix", "concurrency", "sampling", "p_vs_d", "structured")
