"""Logs that carry the job: X-Request-ID, and one JSON line per job event in API and worker.

A real worker and the API under gunicorn, both with ``SWITCHYARD_LOG_FORMAT=json``
and their logs in files, as an operator chasing a slow job would read them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import requests

from config import Settings
from tests import farm
from tests.integration.test_scaling import make_models, settings_for, unique

PROMPT = "Tell me about foxes."
# Celery's signal handler prints this itself, past any logging configuration.
CELERY_PRINTS = ("worker: Warm shutdown (MainProcess)",)


def _lines(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a log file (a line that is not one fails the test)."""
    found = []
    for line in path.read_text().splitlines():
        if not line.strip() or line in CELERY_PRINTS:
            continue
        try:
            found.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"a log line of {path.name} is not JSON: {line!r}") from None
    return found


def _events(lines: list[dict[str, Any]], job_id: str) -> dict[str, dict[str, Any]]:
    return {line["event"]: line for line in lines if line.get("job_id") == job_id}


def test_every_job_event_is_one_json_line_with_the_request_id(
    migrated: Settings, tmp_path: Path
) -> None:
    served, idle = unique("logs"), unique("logs-idle")
    models = make_models(tmp_path / "models", {served: {}, idle: {}})
    settings = settings_for(migrated, models, log_format="json", api_port=farm.free_port())
    token = farm.make_token(settings)
    auth = {"Authorization": f"Bearer {token}"}
    logs = tmp_path / "logs"
    logs.mkdir()
    worker = farm.start_worker(settings, served, logs)
    try:
        worker_id = farm.wait_ready(settings, served, worker)
        with farm.serve_gunicorn(settings, logs) as url:
            body = {"model": served, "prompt": PROMPT, "params": {"max_new_tokens": 8}}
            r = requests.post(
                url + "/v1/jobs",
                json=body,
                headers={**auth, "X-Request-ID": "req-42.a"},
                timeout=30,
            )
            assert r.status_code == 202, r.text
            assert r.headers["X-Request-ID"] == "req-42.a"
            job_id = r.json()["id"]
            final = farm.wait_final(url, token, job_id)
            assert final["status"] == "succeeded"
            assert final["request_id"] == "req-42.a"

            # Not short and printable: replaced by one the API makes, and said so.
            for bad in ("has spaces in it", "x" * 129, "caf\u00e9"):
                r = requests.post(
                    url + "/v1/jobs",
                    json={"model": idle, "prompt": "hi"},
                    headers={**auth, "X-Request-ID": bad.encode().decode("latin-1")},
                    timeout=30,
                )
                assert r.status_code == 202, r.text
                made = r.headers["X-Request-ID"]
                assert re.fullmatch(r"[0-9a-f]{32}", made)
                view = requests.get(f"{url}/v1/jobs/{r.json()['id']}", headers=auth, timeout=30)
                assert view.json()["request_id"] == made
            # Without one, every answer still carries one.
            assert re.fullmatch(
                r"[0-9a-f]{32}", requests.get(url + "/healthz").headers["X-Request-ID"]
            )
            waiting = r.json()["id"]
            assert requests.delete(f"{url}/v1/jobs/{waiting}", headers=auth, timeout=30).ok
    finally:
        worker.stop()

    api_log = next(logs.glob("gunicorn-*.log"))
    api = _events(_lines(api_log), job_id)
    work = _events(_lines(next(logs.glob(f"worker-{served}-*.log"))), job_id)
    assert set(api) == {"submitted", "queued"}
    assert set(work) == {"started", "first_token", "finished"}
    for line in [*api.values(), *work.values()]:
        assert line["request_id"] == "req-42.a"
        assert line["model"] == served
        assert line["logger"] == "switchyard.jobs"
        assert line["message"] == f"job {line['event']}"
        assert line["time"].endswith("+00:00")
    assert api["submitted"]["worker"] is None and api["submitted"]["attempt"] == 0
    assert api["queued"]["queue"] == f"gen.{served}"
    for line in work.values():
        assert line["worker"] == worker_id and line["attempt"] == 1
    assert work["first_token"]["ttft_s"] >= 0
    assert work["finished"]["finish_reason"] in ("length", "stop")
    assert work["finished"]["completion_tokens"] == final["usage"]["completion_tokens"]
    cancelled = _events(_lines(api_log), waiting)
    assert set(cancelled) == {"submitted", "queued", "cancelled"}
    assert cancelled["cancelled"]["request_id"] == made
