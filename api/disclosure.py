"""What a caller may learn about a job's failure and where it ran.

A worker records a failure's full text (an exception's type and message, a
CUDA error, a path on the worker) and its own ``host:pid``: that is for the
people who run the farm. Users, and callers without a token, get the errors
that concern their request as they are (a refused field, a deadline, a
timeout, a job given up after lost workers) and a generic sentence for
everything else; no worker names. Operators and admins see everything.
"""

from __future__ import annotations

import re
from dataclasses import replace

from db.accounts import Principal
from jobs.events import JobEvent

# Errors worded for the client: a refused input field ("prompt: …"), the
# queue deadline, the job timeout, the reaper's "worker lost N times".
PUBLIC_ERROR = re.compile(
    r"^(expired"
    r"|(prompt|messages|params(\.[\w.\[\]]+)?|request_id): .+"
    r"|timed out after \d+ s"
    r"|(worker lost|abandoned by its worker) \d+ times"
    r"|the event stream ended without a final event"
    r"|error|failed)$",
    re.DOTALL,
)
GENERIC_ERROR = "the worker failed to generate an answer (an operator can see the details)"
# Event fields naming the worker process (host:pid).
WORKER_FIELDS = ("worker", "previous_worker")


def sees_internals(principal: Principal | None) -> bool:
    """Operators and admins see workers and full error texts."""
    return principal is not None and principal.sees_all_jobs


def public_error(error: str | None) -> str | None:
    """``error`` when it is worded for the client, else a generic sentence."""
    if error is None or PUBLIC_ERROR.match(error):
        return error
    return GENERIC_ERROR


def event_for(event: JobEvent, full: bool) -> JobEvent:
    """``event`` as a caller sees it: everything when ``full``, else no internals."""
    if full or not (event.type == "error" or any(k in event.fields for k in WORKER_FIELDS)):
        return event
    fields = {k: v for k, v in event.fields.items() if k not in WORKER_FIELDS}
    if event.type == "error" and isinstance(fields.get("error"), str):
        fields["error"] = public_error(fields["error"])
    return replace(event, fields=fields)
