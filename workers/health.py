"""The worker's own health check: is its engine still generating?

Every ``health_check.interval_s`` (after ``initial_delay_s``) the monitor asks
the engine for one token. An engine that is busy and produced tokens in the
last seconds has just proven itself, so it is not probed (a probe would wait
for a batch slot behind real work and time out for nothing). After
``max_retries`` failures in a row — an error, or no answer within
``timeout_s`` — the monitor calls ``on_unhealthy`` once with the reason and
stops; the worker then reports ``failed`` and exits non-zero so its executor
restarts it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from config.catalog import HealthCheck
from models.engine import FinishEvent, GenerationRequest, RequestHandle, SamplingParams

log = logging.getLogger(__name__)


class ProbedEngine(Protocol):
    """What the monitor needs of an engine."""

    @property
    def busy_slots(self) -> int: ...

    def tokens_per_second(self) -> float: ...

    def submit(self, request: GenerationRequest) -> RequestHandle: ...


class HealthMonitor:
    """Probes one engine from a daemon thread; see the module docstring."""

    def __init__(
        self,
        engine: ProbedEngine,
        check: HealthCheck,
        prompt_ids: list[int],
        on_unhealthy: Callable[[str], None],
    ) -> None:
        self.engine = engine
        self.check = check
        self.prompt_ids = prompt_ids
        self.on_unhealthy = on_unhealthy
        self.failures = 0
        self.last_failure: str | None = None
        self._probes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="health-check", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.check.timeout_s + 1)

    def probe(self) -> str | None:
        """One check: None when healthy, else why not."""
        if self.engine.busy_slots > 0 and self.engine.tokens_per_second() > 0:
            return None
        self._probes += 1
        params = SamplingParams(max_new_tokens=1, temperature=0)
        try:
            handle = self.engine.submit(
                GenerationRequest(f"health-{self._probes}", self.prompt_ids, params)
            )
        except Exception as exc:  # a closed or broken engine is exactly what we look for
            return f"{type(exc).__name__}: {exc}"
        deadline = time.monotonic() + self.check.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                handle.cancel()
                return f"no answer within {self.check.timeout_s:g} s"
            event = handle.next_event(timeout=left)
            if isinstance(event, FinishEvent):
                if event.finish_reason == "error":
                    return event.error or "the engine reported an error"
                return None

    def step(self) -> bool:
        """Run one probe and count it; True once the worker is to be declared unhealthy."""
        reason = self.probe()
        if reason is None:
            self.failures = 0
            return False
        self.failures += 1
        self.last_failure = reason
        log.warning(
            "health check failed (%d of %d): %s", self.failures, self.check.max_retries, reason
        )
        return self.failures >= self.check.max_retries

    def _loop(self) -> None:
        if self._stop.wait(self.check.initial_delay_s):
            return
        while not self._stop.wait(self.check.interval_s):
            if self.step():
                self.on_unhealthy(
                    f"health check failed {self.failures} times in a row: {self.last_failure}"
                )
                return
