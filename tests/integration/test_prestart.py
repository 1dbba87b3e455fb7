"""A worker whose pre-start action fails: reported failed with the reason, takes no job."""

from __future__ import annotations

import time
from pathlib import Path

import requests

from config import Settings
from tests import farm

MODEL = "tiny-broken"


def test_failed_prestart_is_reported_and_the_models_jobs_stay_queued(
    api_url: str, user_token: str, admin_token: str, migrated: Settings, log_dir: Path
) -> None:
    headers = {"Authorization": f"Bearer {user_token}"}
    body = {"model": MODEL, "prompt": "hello", "params": {"max_new_tokens": 4}}
    r = requests.post(f"{api_url}/v1/jobs", json=body, headers=headers, timeout=30)
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]

    proc = farm.start_worker(migrated, MODEL, log_dir)
    assert proc.proc.wait(timeout=120) == 3, proc.log()[-3000:]
    assert "no accelerator here" in proc.log()

    # The first action ran before the second failed.
    written = migrated.state_dir / "prestart" / "tiny-broken.txt"
    assert written.read_text() == "written before the failing command"

    admin = {"Authorization": f"Bearer {admin_token}"}
    listed = requests.get(f"{api_url}/v1/admin/workers", headers=admin, timeout=30).json()
    mine = [w for w in listed["workers"] if w["model"] == MODEL and w["pid"] == proc.proc.pid]
    assert len(mine) == 1
    worker = mine[0]
    assert worker["state"] == "failed"
    assert worker["error"].startswith("pre_start_actions[1] (run_command sh): exited with status 7")
    assert "no accelerator here" in worker["error"]
    model = next(m for m in listed["models"] if m["model"] == MODEL)
    assert model["replicas_ready"] == 0 and model["queue_depth"] >= 1

    time.sleep(1.0)
    job = requests.get(f"{api_url}/v1/jobs/{job_id}", headers=headers, timeout=30).json()
    assert job["status"] == "queued" and job["attempts"] == 0 and job["worker"] is None
    written.unlink()


def test_a_model_that_cannot_load_is_failed_in_status_and_metrics(
    api_url: str, user_token: str, admin_token: str, migrated: Settings, log_dir: Path
) -> None:
    """A bad checkpoint path: the worker says why, stays `failed` (not lost), takes no job."""
    model = "tiny-badpath"
    headers = {"Authorization": f"Bearer {user_token}"}
    body = {"model": model, "prompt": "hello", "params": {"max_new_tokens": 4}}
    r = requests.post(f"{api_url}/v1/jobs", json=body, headers=headers, timeout=30)
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]

    proc = farm.start_worker(migrated, model, log_dir)
    assert proc.proc.wait(timeout=120) == 3, proc.log()[-3000:]
    # Past the heartbeat TTL: an exited worker that failed is still "failed".
    time.sleep(migrated.heartbeat_ttl_s + 1)

    admin = {"Authorization": f"Bearer {admin_token}"}
    listed = requests.get(f"{api_url}/v1/admin/workers", headers=admin, timeout=30).json()
    mine = [w for w in listed["workers"] if w["model"] == model and w["pid"] == proc.proc.pid]
    assert len(mine) == 1 and mine[0]["status"] == "failed", mine
    assert "/nonexistent/switchyard-checkpoint" in mine[0]["error"]

    scrape = requests.get(f"{api_url}/metrics", headers=admin, timeout=30).text
    assert f'switchyard_workers{{model="{model}",status="failed"}} 1.0' in scrape
    assert f'switchyard_workers{{model="{model}",status="lost"}} 0.0' in scrape

    job = requests.get(f"{api_url}/v1/jobs/{job_id}", headers=headers, timeout=30).json()
    assert job["status"] == "queued" and job["attempts"] == 0 and job["worker"] is None
    # Every worker of the model failed: a new request is refused with the reason.
    again = requests.post(f"{api_url}/v1/jobs", json=body, headers=headers, timeout=30)
    assert again.status_code == 503
    assert "failed to start" in again.json()["error"]
