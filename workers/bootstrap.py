"""Start one worker process for one model: pre-start, load, warm up, then consume its queue.

The model is loaded once here, before Celery starts consuming, never at import.
Celery runs a threads pool with one slot per engine batch slot, so concurrent
jobs of this process share the engine's forward passes.

Life of a worker, as its heartbeat reports it: ``starting`` (pre-start
actions, loading, one warm-up generation), ``ready`` (consuming), then
``draining`` once told to stop, or ``failed`` with the reason (a pre-start
action or the load failed: exit 3, before any job was taken; the health check
failed ``max_retries`` times: exit 4).

SIGTERM is Celery's warm shutdown: stop consuming and wait for the running
tasks, with no bound. The bound is ours: the runner gets ``worker_grace_s``
to finish, then cancels what is left and re-queues it, so the process exits 0
within about ``worker_grace_s`` and no job waits for a visibility timeout.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
import uuid
from typing import Any

import redis
from celery import signals

from config import ModelDefinition, Settings, load_catalog
from db.jobs import JobStore
from db.session import Database
from fleet.registry import (
    Heartbeat,
    WorkerReport,
    last_start_time,
    load_estimate,
    remember_start_time,
)
from fleet.tokenizers import publish_tokenizer_files, saved_tokenizer_files
from jobs.events import EventLog
from jobs.messages import send_generate
from jobs.metrics import MetricsStore
from jobs.queues import queue_name
from tasks import configure
from tasks.generate import serve_with
from workers.prestart import PreStartFailed, run_prestart

log = logging.getLogger(__name__)


def worker_id_for(model: str) -> str:
    return f"{model}@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def run_worker(settings: Settings, model: str) -> int:
    """Serve ``model`` until told to stop; returns the process exit code."""
    catalog = load_catalog(settings.models_dir)
    definition = catalog.get(model)
    if definition is None:
        raise SystemExit(f"unknown model {model!r}; known: {', '.join(catalog.names)}")
    client = redis.Redis.from_url(settings.redis_url)
    worker_id = worker_id_for(model)
    report = WorkerReport(id=worker_id, model=model, total_slots=definition.limits.task_slots)
    try:  # what the waiting clients' progress bars go by (api/waiting.py)
        report.start_expected_s = last_start_time(client, settings, model)
    except redis.RedisError:
        report.start_expected_s = None

    def loading(r: WorkerReport) -> None:
        r.load_progress, r.load_eta_s = load_estimate(r.started_at, r.start_expected_s)

    heartbeat = Heartbeat(client, settings, report, sample=loading)
    heartbeat.start()
    try:
        run_prestart(definition.pre_start_actions, settings.state_dir)
        engine = _start_engine(settings, definition, catalog, report)
    except PreStartFailed as exc:
        log.error("worker for %s not started: %s", model, exc)
        heartbeat.set_state("failed", error=str(exc))
        heartbeat.stop(forget=False)
        return 3
    except Exception as exc:
        log.exception("worker for %s failed to start", model)
        heartbeat.set_state("failed", error=f"{type(exc).__name__}: {exc}")
        heartbeat.stop(forget=False)
        return 3

    try:  # lets an API without this worker's disk answer POST /tokenize
        publish_tokenizer_files(client, settings, model, saved_tokenizer_files(engine.tokenizer))
    except Exception:
        log.warning("could not publish %s's tokenizer files", model, exc_info=True)

    def sample(r: WorkerReport) -> None:
        r.busy_slots = engine.busy_slots
        r.tokens_per_s = round(engine.tokens_per_second(), 2)
        r.last_job = runner.last_job
        r.active_jobs = runner.active_jobs

    from workers.health import HealthMonitor
    from workers.runner import JobRunner

    # Claims and final rows are redone by the reaper if the database server loses
    # them in a crash; the API's inserts of submitted jobs stay synchronous.
    db = Database.for_process(settings, synchronous_commit=settings.worker_synchronous_commit)
    app = configure(settings)
    runner = JobRunner(
        settings=settings,
        definition=definition,
        engine=engine,
        jobs=JobStore(db),
        events=EventLog(client, settings),
        worker_id=worker_id,
        resend=lambda job_id, name: send_generate(client, settings, job_id, name),
        metrics=MetricsStore(client, settings),
    )
    heartbeat.sample = sample
    serve_with(runner)
    unhealthy: list[str] = []

    def on_unhealthy(reason: str) -> None:
        unhealthy.append(reason)
        log.error("worker %s is unhealthy, stopping: %s", worker_id, reason)
        heartbeat.set_state("failed", error=reason)
        runner.drain(0)  # its engine is broken: hand its jobs to others at once
        os.kill(os.getpid(), signal.SIGTERM)

    health = HealthMonitor(
        engine,
        definition.health_check,
        engine.encode_prompt("ping"),
        on_unhealthy,
    )

    def on_ready(**_: Any) -> None:
        report.load_progress, report.load_eta_s = 100.0, 0.0
        try:
            remember_start_time(client, settings, model, time.time() - report.started_at)
        except redis.RedisError as exc:
            log.warning("could not record the start time: %s", exc)
        from models.engine import freeze_heap

        # Loaded, warmed up and consuming: what the process holds now it holds for life.
        freeze_heap()
        heartbeat.set_state("ready")
        health.start()
        log.info("worker %s ready on queue %s", worker_id, queue_name(model))

    def on_shutdown(**_: Any) -> None:
        # Runs in the signal handler: record the deadline, let the jobs' threads act on it.
        runner.drain(settings.worker_grace_s)
        if not unhealthy:
            heartbeat.set_state("draining")

    signals.worker_ready.connect(on_ready, weak=False)
    signals.worker_shutting_down.connect(on_shutdown, weak=False)
    argv = [
        "worker",
        "--queues",
        queue_name(model),
        "--pool",
        "threads",
        "--concurrency",
        str(definition.limits.task_slots),
        "--hostname",
        f"{model}@{socket.gethostname()}-{os.getpid()}",
        "--without-gossip",
        "--without-mingle",
        "--loglevel",
        settings.log_level,
    ]
    if not settings.task_events:
        # Celery's event heartbeats (what Flower shows as online) only matter with events.
        argv.append("--without-heartbeat")
    if settings.log_format == "json":
        argv.insert(0, "--quiet")  # no banner: every line of the log is an object
    try:
        app.worker_main(argv)
    finally:
        health.stop()
        serve_with(None)
        engine.stop()
        # A failed worker stays listed (as failed, until pruned) so operators see why.
        heartbeat.stop(forget=not unhealthy)
        db.dispose()
    return 4 if unhealthy else 0


def _start_engine(
    settings: Settings, definition: ModelDefinition, catalog: Any, report: WorkerReport
) -> Any:
    import torch

    from models.engine import Engine, GenerationRequest, SamplingParams
    from models.loader import load_model

    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    loaded = load_model(definition, catalog, settings.state_dir / "models")
    report.device = str(loaded.device)
    engine = Engine(
        loaded,
        max_batch_size=definition.limits.max_batch_size,
        max_input_tokens=definition.limits.max_input_tokens,
        max_step_tokens=definition.limits.max_step_tokens,
        prefix_caching=settings.prefix_caching,
        nice=settings.engine_nice,
    )
    engine.start()
    # Warm-up: a worker is ready only once a real generation went through.
    ids = engine.encode_chat([{"role": "user", "content": "Hi"}])
    engine.generate(
        GenerationRequest("warmup", ids, SamplingParams(max_new_tokens=2, temperature=0))
    )
    return engine
