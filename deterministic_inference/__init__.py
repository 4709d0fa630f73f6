"""deterministic-inference: bitwise reproducible LLM inference on CPU, with a provenance workflow."""

__version__ = "0.1.0"
