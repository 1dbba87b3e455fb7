"""The local executor: one worker process per replica on this machine.

* **Start**: ``worker_command(model)``, in a session of its
  own (a Ctrl-C reaches the scaler, which then drains its workers in order).
  When GPUs are listed (``CUDA_VISIBLE_DEVICES``) each replica gets one of
  them, and a model cannot have more replicas than there are free GPUs. The
  host runs at most ``max_local_replicas`` worker processes in all (draining
  ones count: they still hold memory).
* **Drain**: scale-down sends SIGTERM, which is Celery's warm shutdown: the
  worker stops consuming, finishes its running jobs, then exits. Only a worker
  still alive ``drain_grace_s`` later is killed. The replicas drained first
  are those still starting, then the least busy (from their heartbeats), then
  the newest.
* **Crashes**: a worker that exits without being asked to is replaced after a
  backoff that doubles per consecutive crash (``restart_backoff_s`` up to
  ``restart_backoff_max_s``), so a model that cannot start costs one attempt
  per backoff period, not a restart loop. A worker that had served (its
  heartbeat said ``ready``) or ran longer than the longest backoff before
  it died starts the count afresh: a worker killed after a while of honest
  work (OOM killer, ``kill -9``) is replaced after ``restart_backoff_s``,
  however often that happens.
* **Dying with the scaler**: on Linux each worker is started with a parent
  death signal (``prctl(PR_SET_PDEATHSIG, SIGTERM)``): if the scaler dies
  without draining them (SIGKILL, OOM), its workers get SIGTERM, which is the
  same warm shutdown as a drain — they finish or hand back their running jobs
  within ``worker_grace_s`` and exit, instead of living on as orphans that no
  scaler supervises. The signal follows the *thread* that started the worker,
  so the executor must be driven from a thread that outlives its workers (the
  scaler's loop is; ``close()`` drains them before it returns).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import redis

from config import Settings
from config.settings import PROJECT_ROOT
from fleet.registry import RegisteredWorker, list_workers
from workers.lifeline import die_with_parent

log = logging.getLogger(__name__)


def worker_command(model: str) -> list[str]:
    """A model worker's command line (the Procfile's ``worker``)."""
    return [sys.executable, "-m", "cli", "worker", "--model", model]


@dataclass
class Replica:
    """One worker process this executor started."""

    model: str
    proc: subprocess.Popen[bytes]
    gpu: str | None
    started_at: float
    log_file: IO[bytes] | None = field(default=None, repr=False)
    draining_since: float | None = None
    # Wall-clock start, to tell this process's heartbeats from an older one's with its pid.
    wall_started_at: float = field(default_factory=time.time)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def view(self, now: float) -> dict[str, Any]:
        return {
            "model": self.model,
            "pid": self.pid,
            "gpu": self.gpu,
            "state": "draining" if self.draining_since is not None else "running",
            "uptime_s": round(now - self.started_at, 1),
        }


class LocalExecutor:
    """Starts, supervises, drains and stops worker processes on this machine."""

    name = "local"

    def __init__(
        self,
        settings: Settings,
        *,
        client: redis.Redis | None = None,
        env: Mapping[str, str] | None = None,
        log_dir: Path | None = None,
        command: Callable[[str], list[str]] = worker_command,
        clock: Callable[[], float] = time.monotonic,
        stop_grace_s: float | None = None,
    ) -> None:
        self.settings = settings
        # How long close() lets workers drain; the launcher's Ctrl-C wants less.
        self.stop_grace_s = settings.drain_grace_s if stop_grace_s is None else stop_grace_s
        self.client = client
        # Children inherit this process's environment unless given one.
        self.env = dict(env) if env is not None else dict(os.environ)
        self.log_dir = log_dir
        self.command = command
        self.clock = clock
        self.gpus = [g.strip() for g in settings.cuda_visible_devices.split(",") if g.strip()]
        self._replicas: dict[str, list[Replica]] = {}
        self._desired: dict[str, int] = {}
        self._crashes: dict[str, int] = {}
        self._not_before: dict[str, float] = {}
        self._preexec = die_with_parent()

    # --- the executor interface -------------------------------------------------------

    def apply(self, model: str, replicas: int) -> None:
        self._desired[model] = max(0, replicas)
        self._reap()
        self._reconcile(model)

    def poll(self) -> None:
        self._reap()
        self._kill_overdue()
        for model in list(self._desired):
            self._reconcile(model)

    def replicas(self) -> dict[str, int]:
        return {m: len(self._serving(m)) for m in self._desired}

    def processes(self) -> list[dict[str, Any]]:
        """Every process this executor runs, draining ones included."""
        now = self.clock()
        return [r.view(now) for rs in self._replicas.values() for r in rs]

    def close(self) -> None:
        """Drain every worker: SIGTERM, wait up to ``stop_grace_s``, then SIGKILL."""
        self._desired = {m: 0 for m in self._desired}
        everyone = [r for rs in self._replicas.values() for r in rs]
        for r in everyone:
            self._drain(r, "the scaler is stopping")
        deadline = time.monotonic() + self.stop_grace_s
        for r in everyone:
            try:
                r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning(
                    "worker %s (pid %d) still alive after the grace; killing", r.model, r.pid
                )
                r.proc.kill()
                r.proc.wait()
        self._reap()

    # --- internals --------------------------------------------------------------------

    def _serving(self, model: str) -> list[Replica]:
        return [r for r in self._replicas.get(model, []) if r.draining_since is None]

    def _free_gpus(self) -> list[str]:
        taken = {r.gpu for rs in self._replicas.values() for r in rs if r.gpu is not None}
        return [g for g in self.gpus if g not in taken]

    def _reconcile(self, model: str) -> None:
        want = self._desired.get(model, 0)
        serving = self._serving(model)
        if len(serving) > want:
            for r in self._victims(serving)[: len(serving) - want]:
                self._drain(r, f"scaling {model} to {want}")
            return
        missing = want - len(serving)
        if missing <= 0:
            return
        if self.clock() < self._not_before.get(model, 0.0):
            return  # backing off after a crash; poll() tries again
        for _ in range(missing):
            if not self._start(model):
                break

    def _start(self, model: str) -> bool:
        running = sum(len(rs) for rs in self._replicas.values())
        if running >= self.settings.max_local_replicas:
            log.warning(
                "not starting another %s worker: %d worker processes run on this host, the "
                "limit (max_local_replicas)",
                model,
                running,
            )
            return False
        env = dict(self.env)
        gpu = None
        if self.gpus:
            free = self._free_gpus()
            if not free:
                log.warning("no free GPU for another %s worker; %d in use", model, len(self.gpus))
                return False
            gpu = free[0]
            env["CUDA_VISIBLE_DEVICES"] = gpu
        log_file = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_file = (self.log_dir / f"worker-{model}-{time.time_ns()}.log").open("wb")
        proc = subprocess.Popen(
            self.command(model),
            env=env,
            cwd=PROJECT_ROOT,
            stdout=log_file,
            stderr=subprocess.STDOUT if log_file is not None else None,
            start_new_session=True,
            preexec_fn=self._preexec,
        )
        replica = Replica(model, proc, gpu, self.clock(), log_file)
        self._replicas.setdefault(model, []).append(replica)
        log.info("started %s worker pid %d%s", model, proc.pid, f" on GPU {gpu}" if gpu else "")
        return True

    def _victims(self, serving: list[Replica]) -> list[Replica]:
        """Replicas in the order they should be drained: cheapest to lose first."""
        reports: dict[int, RegisteredWorker] = {}
        if self.client is not None:
            host = socket.gethostname()
            try:
                for w in list_workers(self.client, self.settings):
                    if w.host == host and not w.lost:
                        reports[w.pid] = w
            except redis.RedisError as exc:
                log.warning("cannot read heartbeats to pick idle workers: %s", exc)

        def cost(r: Replica) -> tuple[int, int, float]:
            report = reports.get(r.pid)
            ready = 1 if report is not None and report.state == "ready" else 0
            busy = report.busy_slots if report is not None else 0
            return (ready, busy, -r.started_at)

        return sorted(serving, key=cost)

    def _drain(self, r: Replica, why: str) -> None:
        if r.draining_since is not None or r.proc.poll() is not None:
            return
        r.draining_since = self.clock()
        log.info("draining %s worker pid %d (%s)", r.model, r.pid, why)
        r.proc.send_signal(signal.SIGTERM)  # a no-op if it exited meanwhile

    def _kill_overdue(self) -> None:
        now = self.clock()
        for rs in self._replicas.values():
            for r in rs:
                if (
                    r.draining_since is not None
                    and r.proc.poll() is None
                    and now - r.draining_since >= self.settings.drain_grace_s
                ):
                    log.warning(
                        "%s worker pid %d did not finish draining in %.0f s; killing it",
                        r.model,
                        r.pid,
                        self.settings.drain_grace_s,
                    )
                    r.proc.kill()

    def _reap(self) -> None:
        now = self.clock()
        for model, rs in self._replicas.items():
            for r in [r for r in rs if r.proc.poll() is not None]:
                rs.remove(r)
                if r.log_file is not None:
                    r.log_file.close()
                code = r.proc.returncode
                if r.draining_since is not None:
                    log.info(
                        "%s worker pid %d stopped (exit %s) after draining", model, r.pid, code
                    )
                    continue
                lived = now - r.started_at
                fresh = lived > self.settings.restart_backoff_max_s or self._had_served(r)
                crashes = 1 if fresh else self._crashes.get(model, 0) + 1
                self._crashes[model] = crashes
                delay = min(
                    self.settings.restart_backoff_max_s,
                    self.settings.restart_backoff_s * 2 ** (crashes - 1),
                )
                self._not_before[model] = now + delay
                log.warning(
                    "%s worker pid %d exited unexpectedly (exit %s after %.0f s, crash %d in a "
                    "row); replacing it in %.0f s",
                    model,
                    r.pid,
                    code,
                    lived,
                    crashes,
                    delay,
                )

    def _had_served(self, r: Replica) -> bool:
        """Whether ``r``'s last heartbeat (kept in the registry after death) said ready."""
        if self.client is None:
            return False
        host = socket.gethostname()
        try:
            reports = list_workers(self.client, self.settings)
        except redis.RedisError as exc:
            log.warning("cannot read heartbeats to tell a crash loop: %s", exc)
            return False
        return any(
            w.host == host
            and w.pid == r.pid
            and w.started_at >= r.wall_started_at - 1
            and w.state in ("ready", "draining")
            for w in reports
        )
