"""Executors: what turns the scaler's desired replica counts into running workers.

``local`` runs worker processes on this machine; ``kubernetes`` sets the
replica count of each model's Deployment; ``none`` applies nothing (the scaler
still decides, records its decisions and reaps lost jobs — for deployments
whose replicas are fixed, as in docker/compose.yml, or run by KEDA). All are
driven the same way: the scaler calls :meth:`Executor.apply` for every model on every tick (it is
idempotent: applying the same number twice changes nothing), and
:meth:`Executor.poll` often in between so the executor can supervise.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import redis

from config import Settings


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


def build_executor(
    kind: str,
    settings: Settings,
    *,
    client: redis.Redis | None = None,
    env: Mapping[str, str] | None = None,
    log_dir: Path | None = None,
) -> Executor:
    """The executor named ``kind`` (``local`` or ``kubernetes``)."""
    if kind == "local":
        from workers.executors.local import LocalExecutor

        return LocalExecutor(settings, client=client, env=env, log_dir=log_dir)
    if kind == "kubernetes":
        from workers.executors.kubernetes import KubernetesExecutor

        return KubernetesExecutor(settings)
    if kind == "none":
        return RecordOnlyExecutor()
    raise ValueError(f"unknown executor {kind!r}; use 'local', 'kubernetes' or 'none'")
