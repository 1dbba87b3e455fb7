"""Worker reports read back from Redis are typed (fleet/registry.py), whatever wrote them."""

from __future__ import annotations

import json
from dataclasses import asdict

from fleet.registry import RegisteredWorker, Tally, WorkerReport


def test_a_report_reads_back_as_it_was_written() -> None:
    report = WorkerReport("m@h:1:a", "m", state="ready", busy_slots=2, active_jobs=["j"])
    assert WorkerReport.parse(json.dumps(asdict(report)), "m@h:1:a") == report


def test_a_report_of_another_version_takes_defaults_and_drops_unknown_fields() -> None:
    raw = json.dumps({"model": "m", "updated_at": 5.0, "from_the_future": 1})
    worker = RegisteredWorker.parse(raw, "m@h:1:a", lost=True)
    assert (worker.id, worker.model, worker.lost) == ("m@h:1:a", "m", True)
    assert worker.state == "starting"
    # Never this process's host, pid or start time.
    assert (worker.host, worker.pid, worker.started_at) == ("", 0, 0.0)
    assert worker.active_jobs is None and worker.updated_at == 5.0
    assert "from_the_future" not in asdict(worker)


def test_the_tally_counts_live_workers_only() -> None:
    workers = [
        RegisteredWorker("a", "m", state="ready", tokens_per_s=3.0),
        RegisteredWorker("b", "m", state="starting", tokens_per_s=1.0),
        RegisteredWorker("c", "m", state="ready", tokens_per_s=9.0, lost=True),
    ]
    tally = Tally.of(workers)
    assert (tally.ready["m"], tally.starting["m"], tally.tokens_per_s["m"]) == (1, 1, 4.0)
