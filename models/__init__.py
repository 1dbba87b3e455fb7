"""The LLM side of Switchyard: loading models and the batching generation engine.

Import the submodules directly (``models.loader``, ``models.engine``); this
package imports nothing heavy so that importing it stays cheap. It never
imports Flask, Celery or Redis.
"""

from models.errors import (
    EngineClosed,
    EngineError,
    InvalidRequest,
    ModelLoadError,
    ModelsError,
    PromptTooLong,
)

__all__ = [
    "EngineClosed",
    "EngineError",
    "InvalidRequest",
    "ModelLoadError",
    "ModelsError",
    "PromptTooLong",
]
