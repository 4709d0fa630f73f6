"""One exception hierarchy for the product. Every message says what was wrong and how to fix it."""

from __future__ import annotations


class DetinfError(Exception):
    """Base of every error this package raises on purpose (bad input, bad files, refused states)."""


class ConfigError(DetinfError, ValueError):
    """An engine, server or workflow setting is invalid; the message names the field and the fix."""


class ModelLoadError(DetinfError):
    """A model file or directory is missing, corrupt or of an unsupported architecture."""


class UnsupportedArchitectureError(ModelLoadError):
    """The model's architecture is not one the engine implements."""


class InvalidRequestError(DetinfError, ValueError):
    """A request (prompt or sampling parameters) is invalid; maps to HTTP 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class SelfCheckError(DetinfError):
    """A batch-invariance probe differed on this hardware; invariant mode must not start."""


class EngineDeadError(DetinfError):
    """The engine thread stopped after an internal failure; requests can no longer be served."""


class WorkflowError(DetinfError):
    """A manifest, lock, run directory or bundle is invalid or does not match what it claims."""
