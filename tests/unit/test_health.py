"""The worker's health monitor against a fake engine (no model, no services)."""

from __future__ import annotations

import threading

from config.catalog import HealthCheck
from models.engine import FinishEvent, GenerationRequest
from workers.health import HealthMonitor


class FakeHandle:
    def __init__(self, event: FinishEvent | None) -> None:
        self.event = event
        self.cancelled = False

    def next_event(self, timeout: float | None = None) -> FinishEvent | None:
        if self.event is None:
            threading.Event().wait(timeout or 0)
        return self.event

    def cancel(self) -> None:
        self.cancelled = True


class FakeEngine:
    """Answers probes with the queued outcomes: 'ok', 'error', 'hang' or 'raise'."""

    def __init__(self, outcomes: list[str], busy: int = 0, rate: float = 0.0) -> None:
        self.outcomes = outcomes
        self.busy = busy
        self.rate = rate
        self.requests: list[GenerationRequest] = []
        self.handles: list[FakeHandle] = []

    @property
    def busy_slots(self) -> int:
        return self.busy

    def tokens_per_second(self) -> float:
        return self.rate

    def submit(self, request: GenerationRequest) -> FakeHandle:
        self.requests.append(request)
        outcome = self.outcomes.pop(0) if self.outcomes else "ok"
        if outcome == "raise":
            raise RuntimeError("engine thread died")
        event = None
        if outcome == "ok":
            event = FinishEvent("length", "x", 1, 1)
        elif outcome == "error":
            event = FinishEvent("error", "", 1, 0, error="CUDA error: device lost")
        handle = FakeHandle(event)
        self.handles.append(handle)
        return handle


def monitor(engine: FakeEngine, retries: int = 3) -> tuple[HealthMonitor, list[str]]:
    calls: list[str] = []
    check = HealthCheck(interval_s=0.01, max_retries=retries, timeout_s=0.05)
    return HealthMonitor(engine, check, [1, 2, 3], calls.append), calls


def test_a_healthy_engine_is_probed_with_one_token() -> None:
    engine = FakeEngine(["ok"])
    mon, _ = monitor(engine)
    assert mon.step() is False
    assert engine.requests[0].params.max_new_tokens == 1
    assert engine.requests[0].prompt_ids == [1, 2, 3]


def test_failures_must_be_consecutive_to_declare_the_worker_unhealthy() -> None:
    engine = FakeEngine(["error", "hang", "ok", "error", "raise", "error"])
    mon, _ = monitor(engine)
    assert [mon.step() for _ in range(6)] == [False, False, False, False, False, True]
    assert engine.handles[1].cancelled  # a probe that timed out is cancelled
    assert mon.last_failure == "CUDA error: device lost"


def test_a_busy_engine_that_makes_progress_is_not_probed() -> None:
    engine = FakeEngine(["error"], busy=4, rate=120.0)
    mon, _ = monitor(engine)
    assert mon.step() is False
    assert engine.requests == []


def test_the_monitor_thread_reports_once_then_stops() -> None:
    engine = FakeEngine(["error"] * 10)
    mon, calls = monitor(engine, retries=2)
    mon.start()
    mon._thread.join(timeout=5)
    assert len(calls) == 1
    assert calls[0].startswith("health check failed 2 times in a row: CUDA error")
