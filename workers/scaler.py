"""The scaler: one leader computes each model's desired replicas and hands them to an executor.

Several ``switchyard scaler`` processes may run; the one holding the Redis
lock ``<prefix>:scaler:leader`` (a token with a TTL of ``scaler_lock_ttl_s``,
renewed every tick, released on a clean stop) leads, the others retry every
``scaler_interval_s`` and take over once the lock is free or expired.

Every ``scaler_interval_s`` the leader, for each model of the catalog:

* reads the state: queued and running jobs (Postgres), workers (heartbeats),
  the run-time policy (overrides and windows, Postgres), its memory (Redis);
* computes the desired count with :func:`fleet.policy.decide`;
* publishes it in the Redis hash ``<prefix>:scaling:desired`` (read by
  ``/v1/models``, ``switchyard status`` and the admin API), records it in the
  ``scaling_decisions`` table when it changed, and logs why;
* hands it to the executor;
* folds what it saw into the farm's one-minute history (``fleet.history``).

The API pushes a model's name onto the list ``<prefix>:scaler:wake`` when it
enqueues a job for a model whose desired count is zero (or unknown); the
leader waits on that list between ticks, so the first job for a model at zero
starts a worker at once instead of at the next tick. A lost wake-up costs at
most one interval: the count is recomputed from the state every tick.

Liveness: a scaler given ``alive_file`` (``switchyard scaler`` and
``switchyard run``: :attr:`config.Settings.scaler_alive_file`) touches it at
every turn of its loop, leading or standing by, at least once a second
unless a tick is under way. The images' probe (``python -m cli.healthcheck
--scaler``) reads its age: a loop stuck in a tick, or a process stopped,
shows as a file growing old, whether or not Redis answers (a probe that
asked Redis would restart every scaler while Redis is away).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import redis

from config import Catalog, Settings
from db.history import GaugeSample, HistoryStore
from db.jobs import JobStore
from db.overrides import ModelOverrides
from db.overrides import apply as apply_override
from db.scaling import DecisionRecord, ScalingStore
from db.schema import ScalingWindow, utcnow
from db.session import Database
from fleet.history import HistoryRecorder
from fleet.policy import (
    Decision,
    Observation,
    Policy,
    PolicyError,
    decide,
    effective_policy,
)
from fleet.registry import Tally, list_workers
from fleet.scaler_state import LeaderLock, ScalerState, policy_for
from workers.executors.base import Executor, ExecutorError

log = logging.getLogger(__name__)


def scaler_id() -> str:
    return f"scaler@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class Tick:
    """What one tick decided, per model."""

    at: datetime
    decisions: dict[str, Decision]


class Scaler:
    """The scaling loop. :meth:`tick` is one pass; :meth:`run` leads and ticks until stopped."""

    def __init__(
        self,
        settings: Settings,
        catalog: Catalog,
        db: Database,
        client: redis.Redis,
        executor: Executor,
        *,
        ident: str | None = None,
        reaper: Callable[[], Any] | None = None,
        clock: Callable[[], datetime] = utcnow,
        alive_file: Path | None = None,
    ) -> None:
        self.settings = settings
        self.catalog = catalog
        self.jobs = JobStore(db)
        self.store = ScalingStore(db)
        self.redis = client
        self.executor = executor
        self.id = ident or scaler_id()
        # Hook for the reaper of lost workers' jobs (fleet/reaper.py): the
        # leader calls it once per tick so exactly one process reaps.
        self.reaper = reaper
        self.clock = clock
        self.state = ScalerState(client, settings)
        self.history = HistoryRecorder(settings, HistoryStore(db))
        self.lock = LeaderLock(client, self.state.lock_key, settings.scaler_lock_ttl_s, self.id)
        self.leading = False
        self.alive_file = alive_file
        self._alive_failed = False

    def tick(self, now: datetime | None = None) -> Tick:
        """Decide every model's count from the current state and apply it."""
        now = now or self.clock()
        if self.reaper is not None:
            try:
                self.reaper()
            except Exception:  # the reaper failing must not stop scaling
                log.exception("reaper failed")
        counts = self.jobs.active_counts()
        tally = Tally.of(list_workers(self.redis, self.settings))
        ready, starting, tokens_per_s = tally.ready, tally.starting, tally.tokens_per_s
        overrides = self.store.overrides()
        windows: dict[str, list[ScalingWindow]] = {}
        for row in self.store.windows():
            windows.setdefault(row.model, []).append(row)
        memories = self.state.memories()
        published = self.state.desired()
        decisions: dict[str, Decision] = {}
        enabled_at_run_time = ModelOverrides(self.store.db).all()
        for listed in self.catalog:
            model = listed.name
            # An operator may disable a model at run time: it then scales to zero.
            definition = apply_override(listed, enabled_at_run_time.get(model))
            c = counts.get(model, {"queued": 0, "running": 0})
            if not definition.enabled:
                policy = Policy(min_replicas=0, max_replicas=0)
            else:
                try:
                    policy = policy_for(
                        definition.scaling, overrides.get(model), windows.get(model, [])
                    )
                except PolicyError as exc:
                    log.error(
                        "%s: run-time policy is inconsistent (%s); using its definition", model, exc
                    )
                    policy = effective_policy(definition.scaling)
            observation = Observation(
                queued=c["queued"], running=c["running"], replicas=ready[model] + starting[model]
            )
            decision = decide(policy, observation, memories.get(model), now)
            decisions[model] = decision
            self.state.publish(
                model,
                {
                    "desired": decision.desired,
                    "reason": decision.reason,
                    "detail": decision.detail,
                    "at": now.isoformat(),
                    "scaler": self.id,
                    "executor": self.executor.name,
                },
            )
            last = published.get(model, {})
            if decision.changed or last.get("desired") != decision.desired:
                log.info(
                    "%s: %s -> %d replicas (%s: %s)",
                    model,
                    decision.previous if decision.previous is not None else "?",
                    decision.desired,
                    decision.reason,
                    decision.detail,
                )
                self.store.record_decision(
                    DecisionRecord(
                        model=model,
                        at=now,
                        previous=decision.previous,
                        desired=decision.desired,
                        reason=decision.reason,
                        detail=decision.detail,
                        queued=observation.queued,
                        running=observation.running,
                        ready=ready[model],
                        scaler=self.id,
                    )
                )
            else:
                log.debug("%s: %d replicas (%s)", model, decision.desired, decision.detail)
        self.state.remember({m: d.memory for m, d in decisions.items()})
        bound = self.settings.max_replicas_per_model
        samples: dict[str, GaugeSample] = {}
        for model, decision in decisions.items():
            desired = decision.desired
            if desired > bound:  # a model definition's max_replicas above the farm's ceiling
                log.warning(
                    "%s: %d replicas asked, %d at most (max_replicas_per_model)",
                    model,
                    desired,
                    bound,
                )
                desired = bound
            c = counts.get(model, {"queued": 0, "running": 0})
            samples[model] = GaugeSample(
                queue_depth=c["queued"],
                running=c["running"],
                desired=desired,
                ready=ready[model],
                starting=starting[model],
                tokens_per_s=tokens_per_s.get(model, 0.0),
            )
            try:
                self.executor.apply(model, desired)
            except ExecutorError as exc:
                log.error("%s: %s; retrying next tick", model, exc)
        try:
            self.history.record(now, samples)
        except Exception:  # the history failing must not stop scaling
            log.exception("history not recorded")
        return Tick(now, decisions)

    def run(self, stop: threading.Event) -> None:
        """Lead (or stand by) and tick until ``stop`` is set; then step down cleanly."""
        interval = self.settings.scaler_interval_s
        # The lock must be renewed well within its TTL, whatever the interval.
        beat = min(interval, self.settings.scaler_lock_ttl_s / 3, 1.0)
        next_tick = 0.0
        log.info("scaler %s started (executor %s)", self.id, self.executor.name)
        try:
            while not stop.is_set():
                self._mark_alive()
                try:
                    leading = self.lock.hold()
                except redis.RedisError as exc:
                    log.warning("cannot reach Redis for the leader lock: %s", exc)
                    leading = False
                if leading != self.leading:
                    self.leading = leading
                    if leading:
                        log.info("scaler %s leads", self.id)
                        next_tick = 0.0
                    else:
                        log.warning("scaler %s lost the lead; standing by", self.id)
                        self.executor.close()
                if not leading:
                    stop.wait(beat)
                    continue
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + interval
                    self._safe_tick()
                try:
                    woken = self.state.wait_wake(min(beat, max(0.0, next_tick - time.monotonic())))
                except redis.RedisError as exc:
                    log.warning("cannot wait for wake-ups: %s", exc)
                    stop.wait(beat)
                    woken = []
                if woken:
                    log.info("woken for %s", ", ".join(sorted(set(woken))))
                    next_tick = 0.0
                self.executor.poll()
        finally:
            if self.leading:
                with contextlib.suppress(redis.RedisError):  # else it expires by itself
                    self.lock.release()
                self.leading = False
            self.executor.close()
            log.info("scaler %s stopped", self.id)

    def _mark_alive(self) -> None:
        """Touch :attr:`alive_file` (module docstring); a failure is logged once."""
        if self.alive_file is None:
            return
        try:
            try:
                self.alive_file.touch()
            except FileNotFoundError:
                self.alive_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                self.alive_file.touch()
        except OSError as exc:
            if not self._alive_failed:
                log.warning("cannot mark this scaler alive in %s: %s", self.alive_file, exc)
                self._alive_failed = True

    def _safe_tick(self) -> None:
        try:
            self.tick()
        except Exception:  # a database or Redis hiccup: try again next tick
            log.exception("scaler tick failed")


def local_scaler(
    settings: Settings, env: dict[str, str] | None = None, *, stop_grace_s: float | None = None
) -> Scaler:
    """A scaler with the local executor, for ``switchyard run`` (and tests)."""
    from config import load_catalog
    from workers.executors.local import LocalExecutor

    client = redis.Redis.from_url(settings.redis_url)
    executor = LocalExecutor(settings, client=client, env=env, stop_grace_s=stop_grace_s)
    return Scaler(
        settings,
        load_catalog(settings.models_dir),
        Database.for_process(settings),
        client,
        executor,
        alive_file=settings.scaler_alive_file,
    )
