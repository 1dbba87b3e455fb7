"""Start one worker process for one model: load it, warm it up, then consume its queue.

The model is loaded once here, before Celery starts consuming, never at import.
Celery runs a threads pool with one slot per engine batch slot, so concurrent
jobs of this process share the engine's forward passes.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from typing import Any

import redis
from celery import signals

from config import ModelDefinition, Settings, load_catalog
from db.jobs import JobStore
from db.session import Database
from tasks import configure
from tasks.events import EventLog
from tasks.generate import serve_with
from tasks.queues import queue_name
from workers.heartbeat import Heartbeat, WorkerReport

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
    heartbeat = Heartbeat(client, settings, report)
    heartbeat.start()
    try:
        engine = _start_engine(settings, definition, catalog, report)
    except Exception as exc:
        log.exception("worker for %s failed to start", model)
        heartbeat.set_state("failed", error=f"{type(exc).__name__}: {exc}")
        heartbeat.stop(forget=False)
        return 3

    def sample(r: WorkerReport) -> None:
        r.busy_slots = engine.busy_slots
        r.tokens_per_s = round(engine.tokens_per_second(), 2)
        r.last_job = runner.last_job

    from workers.runner import JobRunner

    db = Database(settings.database_url)
    runner = JobRunner(
        settings=settings,
        definition=definition,
        engine=engine,
        jobs=JobStore(db),
        events=EventLog(client, settings),
        worker_id=worker_id,
    )
    heartbeat.sample = sample
    serve_with(runner)
    app = configure(settings)

    def on_ready(**_: Any) -> None:
        heartbeat.set_state("ready")
        log.info("worker %s ready on queue %s", worker_id, queue_name(model))

    def on_shutdown(**_: Any) -> None:
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
        "--without-heartbeat",
        "--loglevel",
        settings.log_level,
    ]
    try:
        app.worker_main(argv)
    finally:
        serve_with(None)
        engine.stop()
        heartbeat.stop(forget=True)
        db.dispose()
    return 0


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
    )
    engine.start()
    # Warm-up: a worker is ready only once a real generation went through.
    ids = engine.encode_chat([{"role": "user", "content": "Hi"}])
    engine.generate(
        GenerationRequest("warmup", ids, SamplingParams(max_new_tokens=2, temperature=0))
    )
    return engine
