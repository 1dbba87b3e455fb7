"""The API's memory with many idle websocket subscribers.

Opens ``count`` websockets to ``/v1/jobs/<id>/ws`` of jobs that stay queued (no
worker serves their model while this runs), holds them open without traffic,
and reads the resident memory of the gunicorn worker process(es) before and
after. Loopback only; bounded in count (the caller's) and in time (every
connect has a timeout, the whole opening phase a deadline). The sockets are
closed and the jobs cancelled afterwards. A refused submission (the model's
queue full of an earlier run's jobs, say) ends the phase with an ``error``,
not the whole benchmark, and the jobs already accepted are cancelled; each job
asks for a deadline of :data:`JOB_DEADLINE_S`, so those of a run stopped
before it cancelled them stop counting against the model's queue then.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass

import psutil
import requests
import websocket

CONNECT_TIMEOUT_S = 10.0
OPEN_DEADLINE_S = 180.0
SETTLE_S = 3.0
SUBMIT_THREADS = 8
# How long a subscriber's job may stay queued unstarted (the API's deadline_s):
# longer than the opening phase (OPEN_DEADLINE_S) and the settling around it.
JOB_DEADLINE_S = 600.0


@dataclass
class SubscriberResult:
    """What :func:`measure_idle_subscribers` saw; memory in bytes."""

    requested: int
    opened: int
    api_rss_before: int
    api_rss_after: int
    api_processes: int
    seconds_to_open: float
    error: str | None = None

    @property
    def per_subscriber(self) -> float:
        return (self.api_rss_after - self.api_rss_before) / self.opened if self.opened else 0.0


def api_worker_rss(master_pid: int) -> tuple[int, int]:
    """Resident bytes of gunicorn's worker processes (the master's children), and their count."""
    master = psutil.Process(master_pid)
    children = master.children(recursive=True)
    return sum(c.memory_info().rss for c in children), len(children)


def _submit(base: str, token: str, model: str) -> str:
    r = requests.post(
        f"{base}/v1/jobs",
        json={
            "model": model,
            "messages": [{"role": "user", "content": "Wait for a worker."}],
            "params": {"max_new_tokens": 1, "temperature": 0},
            "deadline_s": JOB_DEADLINE_S,
        },
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )
    r.raise_for_status()
    return str(r.json()["id"])


def _cancel(base: str, token: str, job_id: str) -> None:
    # Best effort: a job left queued expires at its deadline (JOB_DEADLINE_S).
    with suppress(requests.RequestException):
        requests.delete(
            f"{base}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {token}"}, timeout=30
        )


def _cancel_all(base: str, token: str, job_ids: list[str]) -> None:
    with ThreadPoolExecutor(SUBMIT_THREADS) as pool:
        list(pool.map(lambda j: _cancel(base, token, j), job_ids))


def _submit_all(base: str, token: str, model: str, count: int) -> tuple[list[str], str | None]:
    """``count`` jobs submitted, :data:`SUBMIT_THREADS` at a time: their ids, or, when
    any submission failed, none (those accepted are cancelled) and the first failure."""
    with ThreadPoolExecutor(SUBMIT_THREADS) as pool:
        futures = [pool.submit(_submit, base, token, model) for _ in range(count)]
    failures = [e for e in (f.exception() for f in futures) if e is not None]
    accepted = [f.result() for f in futures if f.exception() is None]
    if not failures:
        return accepted, None
    failure = failures[0]
    _cancel_all(base, token, accepted)
    return [], f"submitting {count} jobs: {type(failure).__name__}: {failure}"


def measure_idle_subscribers(
    base: str, token: str, model: str, count: int, master_pid: int
) -> SubscriberResult:
    """Open ``count`` idle websockets to queued jobs of ``model``; measure the API's RSS.

    No worker may serve ``model`` meanwhile (the jobs must stay queued). Opening
    stops early at the first failure or at the deadline; ``opened`` says how many
    were open when memory was read, ``error`` why fewer than asked.
    """
    ws_base = base.replace("http", "ws", 1)
    job_ids, refused = _submit_all(base, token, model, count)
    if refused is not None:
        rss, processes = api_worker_rss(master_pid)
        return SubscriberResult(count, 0, rss, rss, processes, 0.0, refused)
    time.sleep(SETTLE_S)
    before, processes = api_worker_rss(master_pid)
    sockets: list[websocket.WebSocket] = []
    error: str | None = None
    started = time.monotonic()
    try:
        for job_id in job_ids:
            if time.monotonic() - started > OPEN_DEADLINE_S:
                error = f"deadline of {OPEN_DEADLINE_S:.0f} s reached"
                break
            try:
                ws = websocket.create_connection(
                    f"{ws_base}/v1/jobs/{job_id}/ws",
                    header=[f"Authorization: Bearer {token}"],
                    timeout=CONNECT_TIMEOUT_S,
                )
                # The first frame (the job's `queued` event) proves the relay
                # subscribed this socket; after it the socket stays silent.
                ws.recv()
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                break
            sockets.append(ws)
        seconds = time.monotonic() - started
        time.sleep(SETTLE_S)
        after, processes = api_worker_rss(master_pid)
    finally:
        for ws in sockets:
            with suppress(Exception):
                ws.shutdown()  # no closing handshake: 1,000 of them would take long
        _cancel_all(base, token, job_ids)
    return SubscriberResult(
        requested=count,
        opened=len(sockets),
        api_rss_before=before,
        api_rss_after=after,
        api_processes=processes,
        seconds_to_open=seconds,
        error=error,
    )
