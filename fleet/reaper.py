"""The reaper: no job stays ``running`` on a worker that is gone, none ``queued`` without a message.

One :meth:`Reaper.sweep` does three things, each safe to run from several
processes at once (every change is a conditional UPDATE, a lost race does
nothing):

* **Lost workers.** A running job whose worker has no live heartbeat goes back
  to ``queued`` (only if still running on that worker) and gets a new message
  with the same task id; its lost attempt counts. The next attempt continues
  from the tokens its stream holds (a ``resumed`` event, see
  :mod:`workers.runner`). A job that has used ``max_attempts`` attempts
  fails instead: ``worker lost N times``. A worker counts as lost when its
  heartbeat key is gone and either its last registered beat is older than the
  heartbeat TTL, or this reaper has seen it missing for a TTL — so a Redis
  restart that wiped every heartbeat does not re-queue every running job.
* **Abandoned jobs.** A running job whose worker is alive but has not listed
  it among its heartbeat's ``active_jobs`` for a heartbeat TTL (seen by this
  reaper) is recovered the same way, with reason ``abandoned by its worker``:
  the worker gave up on it, e.g. it could not write the final row while the
  database was away for longer than ``finish_retry_s``.
  The dead worker's unacknowledged message is left to Redis' own re-delivery
  after the visibility timeout; the claim drops it then.
* **Orphaned messages.** A job queued for longer than ``reconcile_after_s``
  whose message is neither waiting in its queue (``<prefix>:gen.<model>``) nor
  freshly delivered (e.g. Redis restarted without persistence, a worker died
  between taking the message and claiming the job, or the message waits under
  a key this farm's broker no longer reads, as after the upgrade that put the
  broker under the prefix) is sent again. A stray duplicate is
  harmless: the claim drops it.
* **Pruning.** Lost workers are forgotten ``worker_prune_after_s`` after
  their last beat.

:class:`ReaperLoop` runs sweeps every ``reaper_interval_s`` — in a thread of
each API process or as ``switchyard reaper`` — and a Redis lock lets only one
process sweep per interval. The scaler may call :meth:`Reaper.sweep` from
its own tick instead.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import redis
from sqlalchemy import exc as sa_exc

from config import Settings, load_catalog
from db.history import GaugeSample, HistoryStore
from db.jobs import JobStore
from db.schema import Job, utcnow
from fleet.history import HistoryRecorder
from fleet.registry import (
    Tally,
    WorkerReport,
    last_beats,
    list_workers,
    live_reports,
    prune_lost,
)
from fleet.scaler_state import ScalerState
from jobs import metrics as m
from jobs.events import EventLog, JobEvent
from jobs.joblog import log_job_event
from jobs.messages import BrokerView, send_generate
from jobs.metrics import MetricsStore

log = logging.getLogger(__name__)

LOST_REASON = "worker lost"
ABANDONED_REASON = "abandoned by its worker"


@dataclass(frozen=True)
class Recovery:
    """One thing a sweep did to one job: ``requeued``, ``failed`` or ``resent``."""

    job_id: str
    model: str
    action: str
    reason: str


class Reaper:
    """Recovers jobs from lost workers and lost messages; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        jobs: JobStore,
        events: EventLog,
        client: redis.Redis,
    ) -> None:
        self.settings = settings
        self.jobs = jobs
        self.events = events
        self.redis = client
        self.broker = BrokerView(client, settings)
        self.metrics = MetricsStore(client, settings)
        self.history = HistoryStore(jobs.db)
        self.recorder = HistoryRecorder(settings, self.history, settings.reaper_interval_s)
        self._models: list[str] | None = None  # the catalog's, read at the first sample
        # Worker id → when this reaper first saw it without a heartbeat (monotonic).
        self._missing_since: dict[str, float] = {}
        # (job id, attempt) → when this reaper first saw its live worker not list it.
        self._unheld_since: dict[tuple[str, int], float] = {}
        self.last_sweep: list[Recovery] = []

    def sweep(self) -> list[str]:
        """One pass of every duty; the ids of the jobs it re-queued, failed or re-sent."""
        done = self.reap_lost() + self.reconcile_queued()
        self.prune_workers()
        try:
            self.record_history()
        except (redis.RedisError, sa_exc.SQLAlchemyError) as exc:  # reaping comes first
            log.warning("history not recorded: %s", exc)
        self.last_sweep = done
        return [r.job_id for r in done]

    def record_history(self) -> bool:
        """While no scaler leads, fold the farm's gauges into its history; whether it did.

        The scaler leader records them at its ticks (with the replicas it
        decided); without one, nothing decided ``desired``, so it stays null.
        """
        if not self.recorder.enabled or self.redis.exists(ScalerState.lock_key_of(self.settings)):
            return False
        if self._models is None:
            self._models = load_catalog(self.settings.models_dir).names
        counts = self.jobs.active_counts()
        tally = Tally.of(list_workers(self.redis, self.settings))
        models = {*self._models, *counts, *tally.ready, *tally.starting}
        samples = {
            model: GaugeSample(
                queue_depth=counts.get(model, {}).get("queued", 0),
                running=counts.get(model, {}).get("running", 0),
                desired=None,
                ready=tally.ready[model],
                starting=tally.starting[model],
                tokens_per_s=tally.tokens_per_s.get(model, 0.0),
            )
            for model in sorted(models)
        }
        self.recorder.record(utcnow(), samples)
        return True

    # -- lost workers -----------------------------------------------------------------

    def lost_workers(self, worker_ids: list[str], live: set[str] | None = None) -> set[str]:
        """The ids among ``worker_ids`` that are gone (see the module docstring).

        ``live``: the ids among them with a live heartbeat, if already read.
        """
        if live is None:
            live = set(live_reports(self.redis, self.settings, worker_ids))
        beats = last_beats(self.redis, self.settings)
        now_wall, now = time.time(), time.monotonic()
        ttl = self.settings.heartbeat_ttl_s
        lost = set()
        for worker_id in worker_ids:
            if worker_id in live:
                self._missing_since.pop(worker_id, None)
                continue
            first_missed = self._missing_since.setdefault(worker_id, now)
            beat = beats.get(worker_id)
            if (beat is not None and now_wall - beat >= ttl) or now - first_missed >= ttl:
                lost.add(worker_id)
        return lost

    def reap_lost(self) -> list[Recovery]:
        """Re-queue or fail the running jobs of lost workers."""
        running = self.jobs.running()
        workers = sorted({j.worker for j in running if j.worker})
        reports = live_reports(self.redis, self.settings, workers)
        lost = self.lost_workers(workers, live=set(reports))
        done: list[Recovery] = []
        for job in running:
            if job.worker is None:
                continue
            if job.worker in lost:
                recovery = self._recover(job, job.worker, LOST_REASON, "worker_lost")
            elif self._abandoned(job, reports.get(job.worker)):
                recovery = self._recover(job, job.worker, ABANDONED_REASON, "abandoned")
            else:
                continue
            if recovery is not None:
                done.append(recovery)
        # Forget workers and jobs no running job names any more.
        for worker_id in set(self._missing_since) - set(workers):
            del self._missing_since[worker_id]
        for key in set(self._unheld_since) - {(j.id, j.attempts) for j in running}:
            del self._unheld_since[key]
        return done

    def _abandoned(self, job: Job, report: WorkerReport | None) -> bool:
        """Whether ``job``'s live worker has left it out of its active jobs for a TTL."""
        active = report.active_jobs if report is not None else None
        key = (job.id, job.attempts)
        if not isinstance(active, list) or job.id in active:
            self._unheld_since.pop(key, None)
            return False
        first = self._unheld_since.setdefault(key, time.monotonic())
        return time.monotonic() - first >= self.settings.heartbeat_ttl_s

    def _recover(self, job: Job, worker: str, reason: str, metric: str) -> Recovery | None:
        labels = {"model": job.model}
        if job.attempts >= self.settings.max_attempts:
            error = f"{reason} {job.attempts} times"
            if not self.jobs.fail_running(job.id, worker, error):
                return None
            self._append(job.id, "error", {"error": error})
            batch = self.metrics.batch()
            batch.inc(m.JOBS_FINISHED, {**labels, "status": "failed"})
            batch.commit()
            log_job_event("failed", job, worker=worker, error=error)
            return self._recorded(Recovery(job.id, job.model, "failed", error), worker)
        if self.jobs.requeue(job.id, worker, count_attempt=True) is None:
            return None
        # No event here: the next attempt continues the stream and says so
        # with ``resumed`` (or ``restart`` when it cannot continue).
        batch = self.metrics.batch()
        batch.inc(m.JOB_RESTARTS, {**labels, "reason": metric})
        batch.commit()
        try:
            send_generate(self.redis, self.settings, job.id, job.model)
        except Exception as exc:  # the row is queued: the reconciler sends it later
            log.warning("job %s re-queued but not sent (%s); will retry", job.id, exc)
        log_job_event("retried", job, worker=worker, reason=reason)
        return self._recorded(Recovery(job.id, job.model, "requeued", reason), worker)

    def _recorded(self, recovery: Recovery, worker: str | None) -> Recovery:
        """Write ``recovery`` into the farm's history (a failure there is only logged)."""
        if self.settings.history_retention_s > 0:
            try:
                self.history.record_recovery(
                    utcnow(),
                    recovery.job_id,
                    recovery.model,
                    recovery.action,
                    recovery.reason,
                    worker,
                )
            except sa_exc.SQLAlchemyError as exc:
                log.warning("job %s: recovery not in the history: %s", recovery.job_id, exc)
        return recovery

    def _append(self, job_id: str, kind: str, fields: dict[str, object]) -> None:
        # Only the winner of the conditional UPDATE gets here, and the lost
        # worker writes no more, so nobody else takes this seq.
        seq = self.events.next_seq(job_id)
        self.events.append(job_id, [JobEvent(seq=seq, type=kind, fields=dict(fields))])

    # -- orphaned messages ------------------------------------------------------------

    def reconcile_queued(self) -> list[Recovery]:
        """Send again the messages of queued jobs the broker no longer holds."""
        after = self.settings.reconcile_after_s
        stale = self.jobs.queued_before(utcnow() - timedelta(seconds=after))
        if not stale:
            return []
        by_model: dict[str, list[str]] = {}
        for job_id, model in stale:
            by_model.setdefault(model, []).append(job_id)
        delivered = self.broker.delivered_ids(since_s=after)
        done: list[Recovery] = []
        for model, ids in by_model.items():
            waiting = self.broker.waiting_ids(model)
            for job_id in ids:
                if job_id in waiting or job_id in delivered:
                    continue
                # Still queued now? (it may have been claimed while we looked)
                job = self.jobs.get(job_id)
                if job is None or job.status != "queued":
                    continue
                send_generate(self.redis, self.settings, job_id, model)
                batch = self.metrics.batch()
                batch.inc(m.JOBS_RESENT, {"model": model})
                batch.commit()
                log_job_event("queued", job, reason="no message in the broker; sent again")
                resent = Recovery(job_id, model, "resent", "no message in the broker")
                done.append(self._recorded(resent, None))
        return done

    # -- the registry -----------------------------------------------------------------

    def prune_workers(self) -> list[str]:
        pruned = prune_lost(self.redis, self.settings, self.settings.worker_prune_after_s)
        if pruned:
            log.info("forgot %d lost worker(s): %s", len(pruned), ", ".join(pruned))
        return pruned


class ReaperLoop:
    """Sweeps every ``reaper_interval_s`` from a daemon thread, one process per interval.

    Each tick takes a Redis lock that lives one interval; whoever holds it
    sweeps, the others skip. ``make_reaper`` builds the reaper in the thread,
    so nothing connects before the loop starts (gunicorn forks first).
    """

    def __init__(self, settings: Settings, make_reaper: Callable[[], Reaper]) -> None:
        self.settings = settings
        self.make_reaper = make_reaper
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = threading.Lock()
        self._token = uuid.uuid4().hex

    def ensure_started(self) -> None:
        """Start the thread once (cheap to call on every request)."""
        if self._thread is not None:
            return
        with self._started:
            if self._thread is None:
                self._thread = threading.Thread(target=self.run, name="reaper", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def run(self) -> None:
        """Sweep until :meth:`stop` (the body of ``switchyard reaper``)."""
        reaper = self.make_reaper()
        lock_key = self.settings.key("reaper", "lock")
        interval = self.settings.reaper_interval_s
        while not self._stop.is_set():
            try:
                if reaper.redis.set(lock_key, self._token, nx=True, px=int(interval * 1000)):
                    done = reaper.sweep()
                    if done:
                        log.info("reaper: %d job(s) recovered", len(done))
            except (redis.ConnectionError, redis.TimeoutError, sa_exc.OperationalError) as exc:
                # A service that is down is retried next tick; its traceback every
                # tick would only bury the log (and costs a parse per line).
                log.warning("reaper sweep failed, retrying in %.0f s: %s", interval, exc)
            except Exception:  # anything else is a bug worth its traceback
                log.exception("reaper sweep failed")
            self._stop.wait(interval)
