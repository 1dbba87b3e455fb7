"""Scaling through real Postgres, Redis, worker processes and the API.

Each test gets a models folder of its own: tiny random models with the policy
it needs, uniquely named so their Celery queues, desired counts and scaler
memory are theirs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
import requests
import yaml

from config import Settings, load_catalog
from config.farm_record import describe_farm
from config.settings import PROJECT_ROOT
from db.scaling import ScalingStore
from db.session import Database
from fleet.controls import ScalingControls
from fleet.registry import RegisteredWorker, list_workers
from fleet.scaler_state import LeaderLock, ScalerState
from tests import farm
from workers.executors.local import LocalExecutor
from workers.scaler import Scaler

CHAT = [{"role": "user", "content": "Tell me a story about a fox."}]


# --- helpers ---------------------------------------------------------------------------


def make_models(folder: Path, models: dict[str, dict[str, Any]]) -> Path:
    """A catalog: SmolLM2 (disabled: only its tokenizer is borrowed) plus tiny models."""
    folder.mkdir(parents=True, exist_ok=True)
    smol = yaml.safe_load((PROJECT_ROOT / "config" / "models" / "smollm2-135m.yaml").read_text())
    smol["enabled"] = False
    (folder / "smollm2-135m.yaml").write_text(yaml.safe_dump(smol))
    tiny = yaml.safe_load((PROJECT_ROOT / "config" / "models" / "tiny-random.yaml").read_text())
    for name, spec in models.items():
        body = {**tiny, "name": name, "scaling": spec.get("scaling", {})}
        if spec.get("slow"):
            # Wider and deeper, so a long job runs for a while on a CPU.
            body["source"] = {**tiny["source"], "hidden_size": 256, "num_hidden_layers": 4}
            body["limits"] = {**tiny["limits"], "max_new_tokens": 2000}
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(body))
    return folder


def unique(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:6]}"


def settings_for(base: Settings, models_dir: Path, **changes: Any) -> Settings:
    # The session's Redis prefix, not one of our own: every reaper of the
    # session (API threads, `switchyard scaler`) judges the running jobs of the
    # shared database by the heartbeats under its prefix, so a second prefix
    # would make each side's workers look lost to the other's reapers.
    return base.model_copy(
        update={
            "models_dir": models_dir,
            "scaler_interval_s": 0.5,
            "scaler_lock_ttl_s": 3.0,
            "restart_backoff_s": 1.0,
            **changes,
        }
    )


def wait_for(check: Callable[[], Any], timeout: float, what: str, every: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def live_workers(settings: Settings, model: str) -> list[RegisteredWorker]:
    client = redis.Redis.from_url(settings.redis_url)
    return [w for w in list_workers(client, settings) if w.model == model and not w.lost]


def ready_pids(settings: Settings, model: str) -> set[int]:
    return {w.pid for w in live_workers(settings, model) if w.state == "ready"}


def make_scaler(
    settings: Settings, log_dir: Path, *, worker_grace_s: float = 600, **kw: Any
) -> Scaler:
    client = redis.Redis.from_url(settings.redis_url)
    env = farm.settings_env(settings)
    # By default a draining worker may finish its running job however slow this
    # machine is (the product's default, 0, hands it over at once).
    env["SWITCHYARD_WORKER_GRACE_S"] = str(worker_grace_s)
    executor = LocalExecutor(settings, client=client, env=env, log_dir=log_dir, stop_grace_s=90)
    catalog = load_catalog(settings.models_dir)
    return Scaler(settings, catalog, Database(settings.database_url), client, executor, **kw)


def controls_for(settings: Settings) -> ScalingControls:
    return ScalingControls(
        settings,
        load_catalog(settings.models_dir),
        Database(settings.database_url),
        redis.Redis.from_url(settings.redis_url),
    )


@contextmanager
def scaler_thread(scaler: Scaler) -> Iterator[Scaler]:
    stop = threading.Event()
    thread = threading.Thread(target=scaler.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield scaler
    finally:
        stop.set()
        thread.join(timeout=180)


def submit(api_url: str, token: str, model: str, **params: Any) -> str:
    params = {"max_new_tokens": 8, "temperature": 0, **params}
    r = requests.post(
        f"{api_url}/v1/jobs",
        json={"model": model, "messages": CHAT, "params": params},
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def job_status(api_url: str, token: str, job_id: str) -> dict[str, Any]:
    r = requests.get(
        f"{api_url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {token}"}, timeout=30
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.fixture
def token(migrated: Settings) -> str:
    """A user of this test alone, so other tests' jobs never count toward its limits."""
    from db.accounts import Accounts

    db = Database(migrated.database_url)
    try:
        accounts = Accounts(db)
        name = unique("scaling-user")
        accounts.add_user(name)
        return accounts.issue_token(name).secret
    finally:
        db.dispose()


def decisions(settings: Settings, model: str) -> list[Any]:
    return list(reversed(ScalingStore(Database(settings.database_url)).decisions(model, 100)))


# --- tests -----------------------------------------------------------------------------


def test_manual_scale_zero_two_one_zero_drains_before_stopping(
    migrated: Settings, token: str, tmp_path: Path, log_dir: Path
) -> None:
    model = unique("sc-manual")
    settings = settings_for(
        migrated,
        make_models(tmp_path / "models", {model: {"slow": True, "scaling": {"max_replicas": 2}}}),
    )
    scaler = make_scaler(settings, log_dir)
    controls = controls_for(settings)
    executor = scaler.executor
    assert isinstance(executor, LocalExecutor)

    def settle(check: Callable[[], Any], what: str, timeout: float = 240) -> Any:
        def step() -> Any:
            executor.poll()
            return check()

        return wait_for(step, timeout, what)

    try:
        scaler.tick()
        assert live_workers(settings, model) == []
        assert ScalerState(scaler.redis, settings).desired()[model]["desired"] == 0

        controls.scale(model, 2, until=None, actor="test")
        scaler.tick()
        two = settle(
            lambda: len(ready_pids(settings, model)) == 2 and ready_pids(settings, model), "2 ready"
        )
        assert {p["pid"] for p in executor.processes()} == two

        controls.scale(model, 1, until=None, actor="test")
        scaler.tick()
        settle(lambda: len(executor.processes()) == 1, "one worker to drain and exit")
        (kept,) = ready_pids(settings, model)
        assert kept in two
        (gone,) = two - {kept}
        with pytest.raises(ProcessLookupError):
            os.kill(gone, 0)

        # The last worker drains with a job running: the job finishes, then it exits.
        with farm.serve_app_in_thread(settings) as api_url:
            job_id = submit(api_url, token, model, max_new_tokens=1000)
            wait_for(
                lambda: job_status(api_url, token, job_id)["status"] == "running",
                240,
                "the job to start",
                every=0.05,
            )
            controls.scale(model, 0, until=None, actor="test")
            drain_at = datetime.now(UTC)
            scaler.tick()
            settle(
                lambda: any(w.state == "draining" for w in live_workers(settings, model)),
                "the worker to report draining",
                60,
            )
            settle(lambda: executor.processes() == [], "the drained worker to exit", 600)
            job = job_status(api_url, token, job_id)
        assert job["status"] == "succeeded", job
        assert job["finish_reason"] == "length" and job["usage"]["completion_tokens"] == 1000
        assert datetime.fromisoformat(job["timestamps"]["finished"]) > drain_at
        assert live_workers(settings, model) == []
        steps = [(d.previous, d.desired, d.reason) for d in decisions(settings, model)]
        assert steps == [(None, 0, "queue"), (0, 2, "manual"), (2, 1, "manual"), (1, 0, "manual")]
    finally:
        executor.close()


def test_scale_down_hands_running_jobs_over_in_seconds_and_their_text_stays_whole(
    migrated: Settings, token: str, tmp_path: Path, log_dir: Path
) -> None:
    """2 → 1 replicas while both generate long jobs: the drained worker hands its
    jobs over at once (the default grace, 0) and exits within 5 s; they continue
    on the other worker and end with the uninterrupted answer."""
    from db.jobs import JobStore
    from jobs.events import EventLog

    model = unique("sc-handover")
    settings = settings_for(
        migrated,
        make_models(tmp_path / "models", {model: {"slow": True, "scaling": {"max_replicas": 2}}}),
    )
    scaler = make_scaler(settings, log_dir, worker_grace_s=0)
    controls = controls_for(settings)
    executor = scaler.executor
    assert isinstance(executor, LocalExecutor)
    jobs = JobStore(Database(settings.database_url))
    events = EventLog(redis.Redis.from_url(settings.redis_url), settings)

    def settle(check: Callable[[], Any], what: str, timeout: float = 240) -> Any:
        def step() -> Any:
            executor.poll()
            return check()

        return wait_for(step, timeout, what, every=0.05)

    def busy_workers(ids: list[str]) -> set[str]:
        return {
            str(j.worker)
            for j in jobs.running()
            if j.id in ids and any(e.type == "token" for e in events.history(j.id))
        }

    try:
        controls.scale(model, 2, until=None, actor="test")
        scaler.tick()
        settle(lambda: len(ready_pids(settings, model)) == 2, "2 ready")
        with farm.serve_app_in_thread(settings) as api_url:
            # Under the tiny model's 512 input tokens with the prompt: always continuable.
            reference_id = submit(api_url, token, model, max_new_tokens=300)
            wait_for(
                lambda: job_status(api_url, token, reference_id)["status"] == "succeeded",
                240,
                "the reference answer",
            )
            answer = job_status(api_url, token, reference_id)["output_text"]
            ids: list[str] = []
            while len(busy_workers(ids)) < 2:
                assert len(ids) < 8, "the jobs did not spread over both workers"
                ids.append(submit(api_url, token, model, max_new_tokens=300))
                wait_for(lambda: busy_workers(ids), 120, "a job generating", every=0.05)
                time.sleep(0.3)
            controls.scale(model, 1, until=None, actor="test")
            began = time.monotonic()
            scaler.tick()
            settle(lambda: len(executor.processes()) == 1, "one worker to hand over and exit", 60)
            scale_down_s = time.monotonic() - began
            for job_id in ids:
                wait_for(
                    lambda j=job_id: (
                        job_status(api_url, token, j)["status"]
                        in ("succeeded", "failed", "cancelled")
                    ),
                    300,
                    f"job {job_id} to end",
                )
        assert scale_down_s < 5, f"the scale-down took {scale_down_s:.1f} s"
        handed = 0
        for job_id in ids:
            row = jobs.get(job_id)
            assert row is not None and row.status == "succeeded", row and row.error
            assert row.output_text == answer and row.completion_tokens == 300
            history = events.history(job_id)
            assert [e.seq for e in history] == list(range(len(history)))
            types = [e.type for e in history]
            assert "restart" not in types
            handed += "resumed" in types
            assert row.attempts == 1  # a drain gives its attempt back
        assert handed >= 1
    finally:
        executor.close()


def test_cron_window_at_a_frozen_clock_sets_min_replicas(
    migrated: Settings, tmp_path: Path, log_dir: Path
) -> None:
    model = unique("sc-window")
    settings = settings_for(
        migrated, make_models(tmp_path / "models", {model: {"scaling": {"max_replicas": 3}}})
    )
    controls = controls_for(settings)
    controls.add_window(
        model, cron="* 9-18 * * 1-5", timezone="Europe/Paris", min_replicas=1, actor="test"
    )
    controls.add_window(
        model, cron="* 0-6 * * *", timezone="Europe/Paris", max_replicas=0, actor="t"
    )
    scaler = make_scaler(settings, log_dir)
    try:
        monday_10_paris = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)
        scaler.tick(monday_10_paris)
        published = ScalerState(scaler.redis, settings).desired()[model]
        assert (published["desired"], published["reason"]) == (1, "window")
        assert "9-18" in published["detail"]
        wait_for(lambda: scaler.executor.poll() or ready_pids(settings, model), 240, "a worker")
        # 03:00 in Paris: the night window's max 0 stops it at once.
        scaler.tick(monday_10_paris + timedelta(hours=17))
        published = ScalerState(scaler.redis, settings).desired()[model]
        assert (published["desired"], published["reason"]) == (0, "window")
        wait_for(
            lambda: (
                scaler.executor.poll()
                or (not scaler.executor.replicas().get(model) and not live_workers(settings, model))
            ),
            120,
            "the worker to stop",
        )
    finally:
        scaler.executor.close()


def test_queue_burst_scales_up_then_down_after_the_delays(
    migrated: Settings, token: str, tmp_path: Path, log_dir: Path
) -> None:
    model = unique("sc-burst")
    policy = {
        "max_replicas": 2,
        "target_jobs_per_replica": 2,
        "downscale_delay_s": 2,
        "scale_to_zero_delay_s": 4,
    }
    settings = settings_for(
        migrated, make_models(tmp_path / "models", {model: {"scaling": policy}})
    )
    with (
        farm.serve_app_in_thread(settings) as api_url,
        scaler_thread(make_scaler(settings, log_dir)),
    ):
        job_ids = [submit(api_url, token, model, max_new_tokens=16) for _ in range(8)]
        for job_id in job_ids:
            job = wait_for(
                lambda j=job_id: (
                    job_status(api_url, token, j)["status"] != "queued"
                    and job_status(api_url, token, j)["status"] != "running"
                    and job_status(api_url, token, j)
                ),
                300,
                f"job {job_id}",
            )
            assert job["status"] == "succeeded", job
        wait_for(
            lambda: (
                [d.desired for d in decisions(settings, model)][-1:] == [0]
                and not live_workers(settings, model)
            ),
            120,
            "scale down to zero",
        )
    steps = decisions(settings, model)
    desired = [d.desired for d in steps]
    assert max(desired) == 2, steps
    up = next(d for d in steps if d.desired == 2)
    assert up.reason in ("queue", "max") and up.queued + up.running >= 3
    assert desired[-1] == 0 and steps[-1].reason == "queue"
    down = steps[desired.index(2) + 1 :]
    assert [d.desired for d in down] in ([1, 0], [0]), steps
    assert any("idle" in d.detail for d in down)


def test_first_job_for_a_model_at_zero_starts_a_worker_without_waiting_a_tick(
    migrated: Settings, token: str, tmp_path: Path, log_dir: Path
) -> None:
    model = unique("sc-zero")
    settings = settings_for(
        migrated,
        make_models(tmp_path / "models", {model: {"scaling": {"max_replicas": 1}}}),
        scaler_interval_s=300,  # far longer than the test: only a wake-up can start a worker
    )
    scaler = make_scaler(settings, log_dir)
    with farm.serve_app_in_thread(settings) as api_url, scaler_thread(scaler):
        state = ScalerState(redis.Redis.from_url(settings.redis_url), settings)
        wait_for(lambda: model in state.desired(), 60, "the first tick")
        assert state.desired()[model]["desired"] == 0
        job_id = submit(api_url, token, model)
        job = wait_for(
            lambda: (
                job_status(api_url, token, job_id)["status"] in ("succeeded", "failed")
                and job_status(api_url, token, job_id)
            ),
            240,
            "the job to finish",
        )
        assert job["status"] == "succeeded", job
    up = [d for d in decisions(settings, model) if d.desired == 1]
    assert up and "from zero" in up[0].detail


def _scaler_process(settings: Settings, log_dir: Path) -> farm.Process:
    env = farm.settings_env(settings)
    env.update(
        {
            "SWITCHYARD_SCALER_INTERVAL_S": str(settings.scaler_interval_s),
            "SWITCHYARD_SCALER_LOCK_TTL_S": str(settings.scaler_lock_ttl_s),
        }
    )
    argv = [sys.executable, "-m", "cli", "scaler", "--executor", "local"]
    return farm.Process(argv, env, log_dir / f"scaler-{time.time_ns()}.log")


def test_two_scalers_one_leads_the_other_takes_over(
    migrated: Settings, tmp_path: Path, log_dir: Path
) -> None:
    model = unique("sc-lead")
    settings = settings_for(migrated, make_models(tmp_path / "models", {model: {}}))
    client = redis.Redis.from_url(settings.redis_url)
    state = ScalerState(client, settings)
    lock = LeaderLock(client, state.lock_key, 1, "")
    first = _scaler_process(settings, log_dir)
    second = _scaler_process(settings, log_dir)
    try:
        leader = wait_for(lock.leader, 120, "a leader")
        pids = {first.proc.pid: first, second.proc.pid: second}
        leader_pid = int(leader.split(":")[1])
        assert leader_pid in pids
        wait_for(lambda: state.desired().get(model, {}).get("scaler") == leader, 60, "a decision")
        time.sleep(2 * settings.scaler_lock_ttl_s)  # the standby keeps standing by
        assert lock.leader() == leader
        assert state.desired()[model]["scaler"] == leader

        assert pids[leader_pid].stop() == 0
        (standby,) = [p for pid, p in pids.items() if pid != leader_pid]
        new_leader = wait_for(
            lambda: (lock.leader() or leader) != leader and lock.leader(), 60, "a takeover"
        )
        assert int(new_leader.split(":")[1]) == standby.proc.pid
        wait_for(
            lambda: state.desired()[model]["scaler"] == new_leader, 60, "the new leader to decide"
        )
        # A leader that dies without releasing the lock is replaced once it expires.
        third = _scaler_process(settings, log_dir)
        try:
            standby.stop(signal.SIGKILL)
            successor = wait_for(
                lambda: (lock.leader() or new_leader) != new_leader and lock.leader(),
                60,
                "a takeover after the lock expired",
            )
            assert int(successor.split(":")[1]) == third.proc.pid
        finally:
            third.stop()
        assert "leads" in standby.log()
    finally:
        first.stop()
        second.stop()


def test_the_scaler_probe_sees_its_loop_stop_and_turn_again(
    migrated: Settings, tmp_path: Path, log_dir: Path
) -> None:
    """What the images' probe of a scaler (``python -m cli.healthcheck --scaler``) tells a
    container runtime: healthy while the loop turns, unhealthy once it stops."""
    model = unique("sc-alive")
    settings = settings_for(
        migrated, make_models(tmp_path / "models", {model: {}}), state_dir=tmp_path / "state"
    )
    env = farm.settings_env(settings)

    def probe(max_age: float) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "cli.healthcheck", "--scaler", "--max-age", str(max_age)]
        return subprocess.run(
            argv, env=env, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60
        )

    first = probe(60)
    assert first.returncode == 1 and "no scaler has run" in first.stderr
    scaler = _scaler_process(settings, log_dir)
    try:
        wait_for(lambda: probe(60).returncode == 0, 120, "the probe to pass")
        os.kill(scaler.proc.pid, signal.SIGSTOP)  # a loop that no longer turns
        try:
            stuck = wait_for(lambda: (r := probe(2)).returncode == 1 and r, 30, "a failed probe")
            assert "the scaler's loop last turned" in stuck.stderr
        finally:
            os.kill(scaler.proc.pid, signal.SIGCONT)
        wait_for(lambda: probe(2).returncode == 0, 30, "the probe to pass again")
    finally:
        scaler.stop()


def _cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return farm.switchyard(farm.settings_env(settings), *args)


def test_scale_schedule_and_status_commands(migrated: Settings, tmp_path: Path) -> None:
    model = unique("sc-cli")
    settings = settings_for(
        migrated, make_models(tmp_path / "models", {model: {"scaling": {"max_replicas": 3}}})
    )
    r = _cli(settings, "scale", model, "2", "--for", "2h", "--as", "alice")
    assert r.returncode == 0, r.stderr
    assert f"{model}: 2 replicas until" in r.stdout
    # The change names the farm it went to, and no scaler runs for this prefix.
    assert f"farm {describe_farm(settings)}" in r.stderr
    assert "warning: no scaler leads this farm" in r.stderr
    view = controls_for(settings).view(model)
    assert view["manual"]["replicas"] == 2 and view["manual"]["by"] == "cli:alice"
    until = datetime.fromisoformat(view["manual"]["until"])
    assert timedelta(hours=1, minutes=59) < until - datetime.now(UTC) <= timedelta(hours=2)

    r = _cli(settings, "scale", model, "9")
    assert r.returncode == 2 and "above max_replicas 3" in r.stderr
    r = _cli(settings, "scale", "no-such-model", "1")
    assert r.returncode == 2 and "no model" in r.stderr
    r = _cli(settings, "scale", model, "--min", "5")
    assert r.returncode == 2 and "min_replicas" in r.stderr
    r = _cli(settings, "scale", model, "--auto", "--max", "4", "--downscale-delay", "30")
    assert r.returncode == 0, r.stderr
    view = controls_for(settings).view(model)
    assert view["manual"] is None
    assert view["effective"]["max_replicas"] == 4 and view["effective"]["downscale_delay_s"] == 30

    r = _cli(
        settings, "schedule", "add", model, "--cron", "* 9-18 * * 1-5", "--tz", "Europe/Paris",
        "--min", "2",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    window_id = int(r.stdout.split()[2])
    r = _cli(settings, "schedule", "add", model, "--cron", "61 * * * *", "--min", "1")
    assert r.returncode == 2 and "cron" in r.stderr
    r = _cli(settings, "schedule", "list", model)
    assert r.returncode == 0 and "* 9-18 * * 1-5" in r.stdout and "Europe/Paris" in r.stdout

    r = _cli(settings, "status", "--json")
    assert r.returncode == 0, r.stderr
    status = json.loads(r.stdout)
    row = next(m for m in status["models"] if m["model"] == model)
    assert row["desired"] is None and row["queued"] == 0  # no scaler ran for this prefix
    r = _cli(settings, "status")
    assert r.returncode == 0 and model in r.stdout and "no scaler has run" in r.stdout

    r = _cli(settings, "schedule", "remove", model, str(window_id))
    assert r.returncode == 0, r.stderr
    r = _cli(settings, "schedule", "remove", model, str(window_id))
    assert r.returncode == 1
    actions = [e["action"] for e in controls_for(settings).audit(model)]
    assert actions == ["schedule_remove", "schedule_add", "auto", "policy", "manual"]


def test_admin_scaling_api(
    migrated: Settings, admin_token: str, user_token: str, tmp_path: Path
) -> None:
    model = unique("sc-api")
    settings = settings_for(
        migrated, make_models(tmp_path / "models", {model: {"scaling": {"max_replicas": 2}}})
    )
    admin = {"Authorization": f"Bearer {admin_token}"}
    base_path = f"/v1/admin/models/{model}"
    with farm.serve_app_in_thread(settings) as url:
        assert requests.get(url + base_path + "/scaling", timeout=30).status_code == 401
        r = requests.get(
            url + base_path + "/scaling",
            headers={"Authorization": f"Bearer {user_token}"},
            timeout=30,
        )
        assert r.status_code == 403 and r.json()["error_type"] == "forbidden"
        r = requests.get(url + "/v1/admin/models/nope/scaling", headers=admin, timeout=30)
        assert r.status_code == 404

        r = requests.get(url + base_path + "/scaling", headers=admin, timeout=30)
        assert r.status_code == 200
        assert r.json()["effective"]["max_replicas"] == 2 and r.json()["manual"] is None

        r = requests.put(
            url + base_path + "/scaling",
            json={"replicas": 2, "for_s": 600, "downscale_delay_s": 12},
            headers=admin,
            timeout=30,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["manual"]["replicas"] == 2 and body["manual"]["until"]
        assert body["effective"]["downscale_delay_s"] == 12
        assert body["overrides"] == {"downscale_delay_s": 12}

        for bad, field in (
            ({"replicas": 3}, "replicas"),
            ({"min_replicas": 3}, "min_replicas"),
            ({"replicas": -1}, "replicas"),
            ({"bogus": 1}, "bogus"),
            ({"for_s": 10}, "(body)"),
        ):
            r = requests.put(url + base_path + "/scaling", json=bad, headers=admin, timeout=30)
            assert r.status_code == 422, (bad, r.text)
            assert r.json()["field"] == field, (bad, r.json())

        r = requests.put(
            url + base_path + "/scaling",
            json={"auto": True, "downscale_delay_s": None},
            headers=admin,
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["manual"] is None
        assert r.json()["overrides"] == {}

        r = requests.post(
            url + base_path + "/schedule",
            json={"cron": "* 22-23,0-6 * * *", "timezone": "Europe/Paris", "max_replicas": 1},
            headers=admin,
            timeout=30,
        )
        assert r.status_code == 201, r.text
        window_id = r.json()["id"]
        assert r.headers["Location"].endswith(f"/schedule/{window_id}")
        r = requests.post(
            url + base_path + "/schedule",
            json={"cron": "* * * * *", "timezone": "Mars/Olympus", "min_replicas": 1},
            headers=admin,
            timeout=30,
        )
        assert r.status_code == 422 and r.json()["field"] == "timezone"
        r = requests.get(url + base_path + "/schedule", headers=admin, timeout=30)
        assert [w["id"] for w in r.json()["windows"]] == [window_id]
        r = requests.delete(url + base_path + f"/schedule/{window_id}", headers=admin, timeout=30)
        assert r.status_code == 204
        r = requests.delete(url + base_path + f"/schedule/{window_id}", headers=admin, timeout=30)
        assert r.status_code == 404

        r = requests.get(url + base_path + "/scaling/audit", headers=admin, timeout=30)
        entries = r.json()["entries"]
        assert [e["action"] for e in entries] == [
            "schedule_remove",
            "schedule_add",
            "auto",
            "policy",
            "manual",
            "policy",
        ]
        assert all(e["actor"].startswith("admin-") for e in entries)

        r = requests.get(url + "/v1/admin/scaling", headers=admin, timeout=30)
        assert r.status_code == 200 and model in [m["model"] for m in r.json()["models"]]
        r = requests.get(url + "/v1/models", headers=admin, timeout=30)
        state = next(m for m in r.json()["data"] if m["id"] == model)["state"]
        assert state["replicas_desired"] is None  # no scaler ran for this prefix
