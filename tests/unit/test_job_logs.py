"""The shape of a job's log lines in both formats, and which request ids are kept."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from api.request_ids import accepted
from config import load_settings
from config.logs import formatter_for
from jobs.joblog import log_job_event


@dataclass
class Row:
    id: str = "j-1"
    model: str = "tiny-random"
    worker: str | None = None
    attempts: int = 0
    request_id: str | None = "req 1"


@pytest.fixture
def written() -> Iterator[tuple[io.StringIO, logging.Handler]]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logger = logging.getLogger("switchyard.jobs")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield out, handler
    logger.removeHandler(handler)


def test_a_json_line_holds_the_job_fields(written: tuple[io.StringIO, logging.Handler]) -> None:
    out, handler = written
    handler.setFormatter(formatter_for(load_settings({}, log_format="json")))
    log_job_event("started", Row(), worker="w-1", queue_wait_s=0.5)
    line = json.loads(out.getvalue())
    assert line["message"] == "job started" and line["level"] == "INFO"
    assert line["logger"] == "switchyard.jobs"
    assert {k: line[k] for k in ("event", "job_id", "model", "worker", "attempt")} == {
        "event": "started",
        "job_id": "j-1",
        "model": "tiny-random",
        "worker": "w-1",
        "attempt": 0,
    }
    assert line["request_id"] == "req 1" and line["queue_wait_s"] == 0.5


def test_a_text_line_names_the_fields_after_the_message(
    written: tuple[io.StringIO, logging.Handler],
) -> None:
    out, handler = written
    handler.setFormatter(formatter_for(load_settings({})))
    log_job_event("failed", Row(worker="w-2", attempts=2), error="worker lost 2 times")
    text = out.getvalue().strip()
    assert " WARNING switchyard.jobs: job failed " in text
    assert "job_id=j-1 model=tiny-random worker=w-2 attempt=2" in text
    assert "request_id='req 1'" in text and "error='worker lost 2 times'" in text


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("req-42.a", True),
        ("0f" * 64, True),  # 128 characters
        ("0f" * 64 + "x", False),
        ("", False),
        ("has space", False),
        ("tab\there", False),
        ("caf\u00e9", False),
        ("line\nbreak", False),
    ],
)
def test_only_short_printable_request_ids_are_kept(given: str, kept: bool) -> None:
    assert accepted(given) == (given if kept else None)
