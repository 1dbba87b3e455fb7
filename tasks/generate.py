"""The generate task: a thin adapter from a Celery message to the job runner.

The message carries only the job id (Celery's task id is the job id too); the
job row is the source of truth for everything else. The runner that does the
work is installed by the worker bootstrap once its model is loaded.
"""

from __future__ import annotations

from typing import Protocol

from jobs.queues import GENERATE_TASK
from tasks.celery import app


class Runner(Protocol):
    def run(self, job_id: str) -> None: ...


_runner: Runner | None = None


def serve_with(runner: Runner | None) -> None:
    """Install the process's runner (worker bootstrap) or remove it (shutdown)."""
    global _runner
    _runner = runner


@app.task(name=GENERATE_TASK, ignore_result=True, acks_late=True, reject_on_worker_lost=True)
def generate(job_id: str) -> None:
    if _runner is None:
        # The message is acknowledged as failed (task_acks_on_failure_or_timeout);
        # the job row stays queued and the reaper's reconciler sends it again.
        raise RuntimeError("this process serves no model: start it with `switchyard worker`")
    _runner.run(job_id)
