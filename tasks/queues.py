"""Queue naming: one Celery queue per served model."""

from __future__ import annotations


def queue_name(model: str) -> str:
    """The Celery queue that holds ``model``'s jobs."""
    return f"gen.{model}"
