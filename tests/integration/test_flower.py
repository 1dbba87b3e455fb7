"""Flower, Celery's own monitor, on the farm's broker sees its workers and its jobs.

Workers send task events and event heartbeats by default (SWITCHYARD_TASK_EVENTS);
Flower is started as an operator would, ``celery -A tasks flower``, with the
farm's environment, and read through its HTTP API.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from config import Settings
from tests import farm


@pytest.fixture
def flower(migrated: Settings, log_dir: Path) -> Iterator[str]:
    if importlib.util.find_spec("flower") is None:
        pytest.fail("flower is a dev requirement: pip install -r requirements-dev.txt")
    port = farm.free_port()
    env = {**farm.settings_env(migrated), "FLOWER_UNAUTHENTICATED_API": "true"}
    argv = [sys.executable, "-m", "celery", "-A", "tasks", "flower"]
    url = f"http://127.0.0.1:{port}"
    with farm.serving(
        [*argv, f"--port={port}", "--address=127.0.0.1"],
        env,
        log_dir / f"flower-{time.time_ns()}.log",
        f"{url}/healthcheck",
    ):
        yield url


def test_flower_shows_the_farm_worker_online_and_a_finished_job(
    flower: str, api_url: str, user_token: str, tiny_worker: farm.Process
) -> None:
    def listed() -> list[str]:
        workers = requests.get(f"{flower}/api/workers", params={"refresh": 1}, timeout=30)
        assert workers.status_code == 200, workers.text
        return [name for name in workers.json() if name.startswith("tiny-random@")]

    assert farm.wait_for("Flower to list the tiny-random worker", listed, timeout=60, every=1)

    def online() -> list[str]:
        # What Flower's dashboard shows as Online: alive by the worker's event heartbeats.
        status = requests.get(f"{flower}/api/workers", params={"status": 1}, timeout=30)
        assert status.status_code == 200, status.text
        return [n for n, alive in status.json().items() if n.startswith("tiny-random@") and alive]

    assert farm.wait_for("Flower to show the worker online", online, timeout=60, every=1)

    def run_job() -> dict[str, Any]:
        r = requests.post(
            f"{api_url}/v1/jobs",
            json={"model": "tiny-random", "prompt": "Hello", "params": {"max_new_tokens": 4}},
            headers={"Authorization": f"Bearer {user_token}"},
            timeout=30,
        )
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        assert farm.wait_final(api_url, user_token, job_id)["status"] == "succeeded"

        def task() -> dict[str, Any] | None:
            tasks = requests.get(f"{flower}/api/tasks", timeout=30).json()
            found = tasks.get(job_id)
            return found if found and found.get("state") == "SUCCESS" else None

        seen: dict[str, Any] = farm.wait_for(
            "Flower to show the job's task succeeded", task, timeout=60, every=1
        )
        return seen

    # Flower's event receiver connects to the broker on its own thread after its
    # HTTP server answers; a job that ran while it joined shows its success without
    # the task-received event that carries the name. A job run after that has both.
    seen = run_job()
    for _ in range(2):
        if seen.get("name") is not None:
            break
        seen = run_job()
    assert seen["name"] == "switchyard.generate"
    assert seen["worker"].startswith("tiny-random@")
