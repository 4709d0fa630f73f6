"""Determinism audit of any OpenAI-compatible endpoint (`detinf audit`)."""
