"""The lookups' limit at the API's edge: ``/tokenize`` and ``/v1/models`` count against the caller.

The limits themselves (per-caller windows and slots, queue length) live in
:mod:`jobs.limits`, Flask-free; a submission's are taken by
:meth:`jobs.service.JobService.submit`.
"""

from __future__ import annotations

from api.auth import client_address
from api.errors import refusal_error
from api.services import services
from db.accounts import Principal
from jobs.errors import OverLimit
from jobs.limits import Limiter, caller_for


def count_lookup(principal: Principal | None) -> None:
    """Count this request as one of the caller's lookups (:meth:`Limiter.admit_lookup`);
    :class:`~api.errors.RateLimited` past the caller's limit."""
    svc = services()
    caller = caller_for(principal, client_address(), svc.settings)
    try:
        Limiter(svc.redis, svc.settings).admit_lookup(caller)
    except OverLimit as exc:
        raise refusal_error(exc) from None
