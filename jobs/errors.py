"""The job package's exceptions: why the farm will not take a request, and a reader too slow.

The refusals of :mod:`jobs.service` and :mod:`jobs.limits` carry their data
and know no HTTP; the API gives each its status code and body in one place
(:func:`api.errors.refusal_error`), so a test or another process sees the
same refusals the front doors answer.
"""

from __future__ import annotations


class JobRefused(Exception):
    """A request the farm will not take; ``field`` names the input to blame, if one is."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class UnknownModel(JobRefused):
    """The model is not served here: not in the catalog, or disabled."""


class TokenRequired(JobRefused):
    """A private model, asked for without a token."""


class InvalidRequest(JobRefused):
    """A request that is well formed but cannot be served as it is: a parameter over
    the model's limits, an idempotency key reused for a different request."""


class OverLimit(JobRefused):
    """A limit is full (a queue, a caller's jobs or requests per minute); worth
    trying again after ``retry_after_s`` seconds."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unservable(JobRefused):
    """No worker of the model can ever come (its scaling allows none, or every one failed)."""


class QueueDown(JobRefused):
    """The job queue (Redis, the broker) could not take the job; nothing was accepted."""


class ReaderLagging(Exception):
    """A reader of a job's events fell behind: its subscription's buffer of live
    events overflowed (:meth:`jobs.service.JobService.follow` with a watch)."""
