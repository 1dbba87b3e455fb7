"""What every executor is: the protocol the scaler drives, its error, and the no-op one."""

from __future__ import annotations

from typing import Protocol


class ExecutorError(RuntimeError):
    """An executor could not apply a replica count (the scaler retries next tick)."""


class Executor(Protocol):
    name: str

    def apply(self, model: str, replicas: int) -> None:
        """Make ``model`` run ``replicas`` workers (scale-down drains)."""

    def poll(self) -> None:
        """Supervise between ticks: reap, restart with backoff, enforce grace periods."""

    def replicas(self) -> dict[str, int]:
        """Workers per model this executor runs (not counting draining ones)."""

    def close(self) -> None:
        """Stop supervising; the local executor drains and stops its workers."""


class RecordOnlyExecutor:
    """Applies nothing: replicas are someone else's (compose services, KEDA)."""

    name = "none"

    def apply(self, model: str, replicas: int) -> None:
        return None

    def poll(self) -> None:
        return None

    def replicas(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        return None
