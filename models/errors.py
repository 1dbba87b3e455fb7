"""The exceptions of the ``models`` package, each carrying its data.

The API and the worker translate these at their edges (status codes, event
bodies); nothing in ``models`` knows about HTTP.
"""

from __future__ import annotations


class ModelsError(Exception):
    """Base of every error raised by the ``models`` package."""


class ModelLoadError(ModelsError):
    """A model definition could not be turned into a loaded model."""

    def __init__(self, model: str, message: str) -> None:
        super().__init__(f"{model}: {message}")
        self.model = model


class EngineError(ModelsError):
    """The generation engine refused or failed a request."""


class EngineClosed(EngineError):
    """A request was submitted to an engine that has been stopped."""


class InvalidRequest(EngineError):
    """A request's field has a value the engine cannot serve (a client error)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class PromptTooLong(InvalidRequest):
    """The prompt has more tokens than the engine's ``max_input_tokens``."""

    def __init__(self, n_tokens: int, limit: int, field: str = "prompt") -> None:
        super().__init__(field, f"the prompt has {n_tokens} tokens, above the limit of {limit}")
        self.n_tokens = n_tokens
        self.limit = limit
