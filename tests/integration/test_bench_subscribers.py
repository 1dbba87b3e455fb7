"""The benchmark's idle-subscriber phase against the real API when the model's queue
refuses its jobs: the phase ends with the refusal as its error, the benchmark goes
on, and no job it had submitted is left queued."""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import select

from bench.subscribers import JOB_DEADLINE_S, measure_idle_subscribers
from config import Settings
from db.schema import Job, JobStatus
from db.session import Database
from tests.farm import make_token, serve_app_in_thread


def _jobs_of(settings: Settings, model: str) -> list[Job]:
    db = Database(settings.database_url)
    try:
        with db.session() as s:
            return list(s.execute(select(Job).where(Job.model == model)).scalars())
    finally:
        db.dispose()


def test_a_full_queue_ends_the_phase_and_leaves_no_job_queued(
    migrated: Settings, tmp_path: Path
) -> None:
    # A model of its own, served by no worker (the subscribers' jobs must stay queued).
    models = tmp_path / "models"
    models.mkdir()
    for path in migrated.models_dir.glob("*.yaml"):
        (models / path.name).write_text(path.read_text())
    tiny = (migrated.models_dir / "tiny-random.yaml").read_text()
    (models / "tiny-subs.yaml").write_text(tiny.replace("name: tiny-random", "name: tiny-subs"))
    settings = migrated.model_copy(update={"models_dir": models, "max_queue_length": 3})
    token = make_token(settings, "admin")
    with serve_app_in_thread(settings) as base:
        # 8 submit at once, so up to 8 may pass the check before the queue counts 3;
        # the rest find it full.
        result = measure_idle_subscribers(base, token, "tiny-subs", 20, os.getpid())
    assert result.opened == 0
    assert result.error is not None and "429" in result.error, result.error
    jobs = _jobs_of(settings, "tiny-subs")
    assert jobs, "some submissions were accepted before the queue filled"
    assert all(j.status == JobStatus.cancelled.value for j in jobs), [j.status for j in jobs]
    for job in jobs:
        assert job.deadline_at is not None and job.created_at is not None
        assert (job.deadline_at - job.created_at).total_seconds() <= JOB_DEADLINE_S + 1
