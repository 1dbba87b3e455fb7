"""Queue naming: one Celery queue per served model, and the name of the task its messages run."""

from __future__ import annotations

GENERATE_TASK = "switchyard.generate"
"""The task every generate message names (``tasks.generate`` registers it)."""


def queue_name(model: str) -> str:
    """The Celery queue that holds ``model``'s jobs."""
    return f"gen.{model}"
