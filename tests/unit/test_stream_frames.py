"""One shape per event and per error, whichever door or stream carries it."""

from __future__ import annotations

from api.envelopes import tgi_body
from api.multiplex import MessageRate, event_frame
from api.submission import JobFailed
from config import load_settings
from jobs.events import JobEvent


def test_tgi_names_a_failed_generation_generation_streamed_or_not() -> None:
    # The non-streaming answer and the streamed error event are both built by tgi_body.
    assert tgi_body(JobFailed("CUDA out of memory"))["error_type"] == "generation"
    assert tgi_body(JobFailed("expired"))["error_type"] == "overloaded"
    assert tgi_body(JobFailed("prompt: too long"))["error_type"] == "validation"


def test_multiplexed_frames_carry_every_field_of_the_job_stream() -> None:
    started = JobEvent(seq=1, type="started", fields={"attempt": 2, "worker": "w-1"})
    restart = JobEvent(
        seq=5, type="restart", fields={"reason": "worker lost", "attempt": 2, "worker": "w-1"}
    )
    for event in (started, restart):
        frame = event_frame(event, "req", "job-1")
        assert frame == {**event.as_dict(), "id": "req", "job_id": "job-1"}
    error = event_frame(JobEvent(seq=3, type="error", fields={"error": "expired"}), "r", "j")
    assert (error["error_type"], error["status"]) == ("expired", 503)
    failed = event_frame(JobEvent(seq=3, type="error", fields={"error": "boom"}), "r", "j")
    assert (failed["error_type"], failed["status"]) == ("generation_error", 500)
    assert failed["error"] == "boom"


def test_the_message_bucket_refuses_past_its_burst_and_counts_refusals() -> None:
    rate = MessageRate(load_settings({}, ws_max_messages_per_s=0.001, ws_message_burst=3))
    assert [rate.take() for _ in range(3)] == [True, True, True]
    assert not rate.take() and not rate.flooding
    assert not rate.take() and not rate.take()
    assert rate.flooding
    assert rate.retry_after_s() > 0
