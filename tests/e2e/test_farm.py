"""The farm as a user runs it: gunicorn and a smollm2-135m worker as real processes."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from config import Settings
from config.settings import PROJECT_ROOT
from tests import farm


@pytest.fixture(scope="module")
def gunicorn_url(migrated: Settings, log_dir: Path) -> Iterator[str]:
    argv = [
        sys.executable,
        "-m",
        "gunicorn",
        "-c",
        str(PROJECT_ROOT / "api" / "gunicorn_conf.py"),
        "api:create_app()",
    ]
    proc = farm.Process(argv, farm.settings_env(migrated), log_dir / "gunicorn.log")
    url = f"http://127.0.0.1:{migrated.api_port}"
    try:
        farm.wait_http(url + "/healthz")
        yield url
    finally:
        assert proc.stop() == 0, proc.log()[-3000:]


@pytest.fixture(scope="module")
def smollm_worker(migrated: Settings, log_dir: Path) -> Iterator[farm.Process]:
    proc = farm.start_worker(migrated, "smollm2-135m", log_dir)
    try:
        farm.wait_ready(migrated, "smollm2-135m", proc, timeout=600)
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()[-3000:]


def test_paris_over_gunicorn_websocket_and_sse(
    gunicorn_url: str, smollm_worker: farm.Process, user_token: str
) -> None:
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "params": {"max_new_tokens": 32, "temperature": 0},
    }
    r = requests.post(
        f"{gunicorn_url}/v1/jobs",
        json=body,
        headers={"Authorization": f"Bearer {user_token}"},
        timeout=30,
    )
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    events = farm.ws_events(gunicorn_url, job_id, user_token)
    assert events[-1]["type"] == "done", events[-1]
    text = "".join(e["text"] for e in events if e["type"] == "token")
    assert "Paris" in text
    assert [e["seq"] for e in events] == list(range(len(events)))
    assert farm.sse_events(gunicorn_url, job_id, user_token) == events
    job = requests.get(
        f"{gunicorn_url}/v1/jobs/{job_id}",
        headers={"Authorization": f"Bearer {user_token}"},
        timeout=30,
    ).json()
    assert job["status"] == "succeeded" and job["output_text"] == text
    assert job["finish_reason"] == "eos_token"
    models = requests.get(
        f"{gunicorn_url}/v1/models", headers={"Authorization": f"Bearer {user_token}"}, timeout=30
    ).json()["data"]
    assert next(m for m in models if m["id"] == "smollm2-135m")["state"]["replicas_ready"] == 1
