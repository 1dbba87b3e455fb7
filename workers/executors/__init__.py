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

import redis

from config import Settings
from workers.executors.base import Executor, RecordOnlyExecutor


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
