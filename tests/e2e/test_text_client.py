"""`switchyard chat` driven in a real terminal (pexpect) against gunicorn and a tiny worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pexpect
import pytest
import requests

from config import Settings
from config.settings import PROJECT_ROOT
from tests import farm

CLI = [sys.executable, "-m", "cli", "chat"]
PROMPT = "you> "


@pytest.fixture(scope="module")
def farm_url(migrated: Settings, log_dir: Path, tiny_worker: farm.Process) -> Iterator[str]:
    with farm.serve_gunicorn(migrated, log_dir) as url:
        yield url


def client_env() -> dict[str, str]:
    # The client reads SY_URL / SY_TOKEN; make sure the test's own env does not leak in.
    return {k: v for k, v in os.environ.items() if k not in ("SY_URL", "SY_TOKEN")}


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args],
        cwd=PROJECT_ROOT,
        env=client_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def as_from_a_shell() -> None:
    """Ctrl-C reaches the client as it does when a shell starts it in the foreground.

    A test run started in the background by a non-interactive shell (``make test &``
    in a script) inherits SIGINT and SIGQUIT ignored, and an ignored signal stays
    ignored across exec, so the client would never see Ctrl-C.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def spawn(*args: str) -> pexpect.spawn:
    child = pexpect.spawn(
        CLI[0],
        [*CLI[1:], *args],
        cwd=str(PROJECT_ROOT),
        env=client_env(),
        encoding="utf-8",
        timeout=120,
        dimensions=(40, 200),
        preexec_fn=as_from_a_shell,
    )
    return child


def job_status(url: str, token: str, job_id: str) -> str:
    r = requests.get(
        f"{url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {token}"}, timeout=30
    )
    return str(r.json()["status"])


def wait_status(url: str, token: str, job_id: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    status = job_status(url, token, job_id)
    while status in ("queued", "running") and time.monotonic() < deadline:
        time.sleep(0.2)
        status = job_status(url, token, job_id)
    return status


def test_one_prompt_for_scripts(farm_url: str, user_token: str) -> None:
    done = run_cli(
        "--url", farm_url, "--token", user_token, "--model", "tiny-random",
        "--param", "max_new_tokens=12", "--prompt", "Name a colour.",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), done.stderr  # the answer (random words from a random model)


def test_json_prints_every_event_in_order(farm_url: str, user_token: str) -> None:
    done = run_cli(
        "--url", farm_url, "--token", user_token, "--model", "tiny-random",
        "--param", "max_new_tokens=12", "--json", "--prompt", "Hello",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert [e["seq"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "queued" and events[-1]["type"] == "done"
    assert "token" in {e["type"] for e in events}
    text = "".join(e["text"] for e in events if e["type"] == "token")
    assert events[-1]["text"] == text
    job_id = events[0]["job_id"]
    assert wait_status(farm_url, user_token, job_id) == "succeeded"


def test_clear_messages_for_wrong_url_token_and_model(farm_url: str, user_token: str) -> None:
    nobody = f"http://127.0.0.1:{farm.free_port()}"
    done = run_cli("--url", nobody, "--token", user_token, "--prompt", "hi")
    assert done.returncode == 1
    assert f"cannot reach Switchyard at {nobody}" in done.stderr
    assert "Traceback" not in done.stderr

    done = run_cli("--url", farm_url, "--token", "sy_wrong", "--prompt", "hi")
    assert done.returncode == 1
    assert "the API token was refused" in done.stderr
    assert "Traceback" not in done.stderr

    done = run_cli("--url", farm_url, "--token", user_token, "--model", "nope", "--prompt", "hi")
    assert done.returncode == 1
    assert "unknown model 'nope'" in done.stderr and "tiny-random" in done.stderr

    done = run_cli("--url", farm_url, "--model", "tiny-random", "--prompt", "hi")
    assert done.returncode == 1
    assert "pass --token or set SY_TOKEN" in done.stderr


def test_repl_streams_keeps_conversation_and_commands(farm_url: str, user_token: str) -> None:
    child = spawn("--url", farm_url, "--token", user_token, "--model", "tiny-random")
    try:
        child.expect("Switchyard chat: tiny-random")
        child.expect_exact(PROMPT)
        child.sendline("/params temperature=0.2 max_tokens=8")
        child.expect("params: temperature=0.2 max_new_tokens=8")
        child.expect_exact(PROMPT)
        child.sendline("/system You are terse.")
        child.expect("system prompt set")
        child.expect_exact(PROMPT)
        child.sendline("/model nope")
        child.expect("unknown model 'nope'")
        child.expect_exact(PROMPT)
        child.sendline("First question")
        child.expect_exact(PROMPT)
        child.sendline("Second question")
        child.expect_exact(PROMPT)
        child.sendline("/new")
        child.expect("new conversation")
        child.expect_exact(PROMPT)
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    # The second prompt went out with the first turn: the farm's job rows show it.
    jobs = recent_jobs(user_token, 2)
    first, second = jobs[-2], jobs[-1]
    assert [m["role"] for m in first["messages"]] == ["system", "user"]
    assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant", "user"]
    assert second["messages"][1]["content"] == "First question"
    assert second["messages"][2]["content"] == first["output_text"]
    assert second["params"] == {"temperature": 0.2, "max_new_tokens": 8}


def recent_jobs(token: str, n: int) -> list[dict]:
    """The user's last ``n`` jobs, oldest first, read straight from Postgres."""
    from db.accounts import Accounts
    from db.session import Database

    db = Database(farm.tests_database_url())
    try:
        principal = Accounts(db).authenticate(token)
        assert principal is not None
        from sqlalchemy import select

        from db.schema import Job

        with db.session() as s:
            rows = (
                s.execute(
                    select(Job)
                    .where(Job.user_id == principal.user_id)
                    .order_by(Job.created_at.desc())
                    .limit(n)
                )
                .scalars()
                .all()
            )
            return [
                {"messages": j.messages, "output_text": j.output_text, "params": j.params}
                for j in reversed(rows)
            ]
    finally:
        db.dispose()


def test_ctrl_c_cancels_the_running_generation(farm_url: str, user_token: str) -> None:
    # tiny-late has no worker, so the job is certainly still unfinished when
    # Ctrl-C lands; --json shows its id.
    child = spawn("--url", farm_url, "--token", user_token, "--model", "tiny-late", "--json")
    try:
        child.expect_exact(PROMPT)
        child.sendline("Wait for me")
        child.expect(r'"job_id": "([0-9a-f-]{36})", "seq": 0, "type": "queued"')
        job_id = child.match.group(1)
        child.sendintr()
        child.expect("cancelling")
        child.expect('"finish_reason": "cancelled"')
        child.expect(r"\[cancelled\]")
        child.expect_exact(PROMPT)
        assert wait_status(farm_url, user_token, job_id) == "cancelled"
        child.sendintr()  # at the prompt Ctrl-C only clears the line
        child.expect_exact(PROMPT)
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    assert child.signalstatus is None or child.signalstatus != signal.SIGINT


def test_a_prompt_waiting_for_a_worker_says_so(farm_url: str, user_token: str) -> None:
    # tiny-late has no worker, starting or ready: the client says what it waits for.
    child = spawn(
        "--url", farm_url, "--token", user_token, "--model", "tiny-late",
        "--prompt", "Are you there?",
    )  # fmt: skip
    try:
        child.expect("waiting for a worker of this model to be started", timeout=30)
        child.sendintr()
        # The job is cancelled, not left queued for whoever serves tiny-late next.
        child.expect(r"\[cancelled\]", timeout=30)
        child.expect(pexpect.EOF, timeout=30)
    finally:
        child.terminate(force=True)
