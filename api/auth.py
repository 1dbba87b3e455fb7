"""Bearer-token authentication and role checks.

A token comes in ``Authorization: Bearer <token>``. Browsers' websockets cannot
set headers, and a token in a URL ends up in proxies' logs and histories, so a
websocket may instead offer it as a subprotocol: ``new WebSocket(url,
["switchyard", "bearer.<token>"])`` (the server answers with ``switchyard``,
never echoing the token). The ``token`` query parameter is accepted only where
a browser has no other way, a job's server-sent events (``EventSource`` sends
neither headers nor subprotocols); anywhere else it is a 401 that says where
the token goes, rather than a request silently treated as anonymous.

A bad token is always a 401, even on a public model: a client that sent a
credential expects it to be used.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, Literal, TypeVar, cast

from flask import g, request
from sqlalchemy.exc import SQLAlchemyError

from api.errors import Forbidden, Unauthorized
from api.services import services
from db.accounts import Principal
from db.schema import Role

log = logging.getLogger(__name__)

ADMINS = (Role.admin.value,)
OPERATORS = (Role.admin.value, Role.operator.value)
View = TypeVar("View", bound=Callable[..., Any])

SUBPROTOCOL = "switchyard"
SUBPROTOCOL_TOKEN_PREFIX = "bearer."


def _subprotocol_token() -> str | None:
    offered = request.headers.get("Sec-WebSocket-Protocol", "")
    for item in offered.split(","):
        item = item.strip()
        if item.lower().startswith(SUBPROTOCOL_TOKEN_PREFIX) and len(item) > 7:
            return item[len(SUBPROTOCOL_TOKEN_PREFIX) :]
    return None


# Where a token may come from besides the Authorization header.
Door = Literal["http", "websocket", "event_stream"]
QUERY_TOKEN_REFUSED = (
    "an API token in the URL (?token=) is accepted on server-sent events only: "
    "send it in the Authorization header{}"
)


def presented_token(*, door: Door = "http") -> str | None:
    """The token the request carries, or None; a malformed header is a 401.

    A ``websocket`` also accepts the ``bearer.<token>`` subprotocol, an
    ``event_stream`` the ``token`` query parameter; a ``token`` query parameter
    anywhere else is a 401.
    """
    if door != "event_stream" and "token" in request.args:
        hint = " or the websocket subprotocol 'bearer.<token>'" if door == "websocket" else ""
        raise Unauthorized(QUERY_TOKEN_REFUSED.format(hint))
    header = request.headers.get("Authorization", "")
    if header:
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise Unauthorized("the Authorization header must be 'Bearer <token>'")
        return value.strip()
    if door == "websocket":
        return _subprotocol_token()
    if door == "event_stream":
        return request.args.get("token") or None
    return None


def optional_principal(*, door: Door = "http") -> Principal | None:
    """The caller, None when no token was sent; a bad token is always 401."""
    token = presented_token(door=door)
    if token is None:
        return None
    principal = services().accounts.authenticate(token)
    if principal is None:
        raise Unauthorized("the API token is invalid, expired or revoked")
    return principal


def require_principal(*, door: Door = "http") -> Principal:
    principal = optional_principal(door=door)
    if principal is None:
        raise Unauthorized()
    return principal


def require_role(*roles: str) -> Principal:
    """The caller, who must hold one of ``roles``: 401 without a token, 403 otherwise."""
    principal = require_principal()
    if principal.role not in roles:
        raise Forbidden(f"this needs the role {' or '.join(roles)}")
    return principal


def role_required(*roles: str) -> Callable[[View], View]:
    """A view only callers holding one of ``roles`` may call (see :func:`require_role`).

    The view finds its caller with :func:`caller`.
    """

    def decorate(view: View) -> View:
        @functools.wraps(view)
        def checked(*args: Any, **kwargs: Any) -> Any:
            g.principal = require_role(*roles)
            return view(*args, **kwargs)

        return cast(View, checked)

    return decorate


def caller() -> Principal:
    """The caller :func:`role_required` let through to this request's view."""
    principal = g.get("principal")
    assert isinstance(principal, Principal), "the view is not decorated with role_required"
    return principal


def client_address() -> str:
    """The client's address, for the limits of callers without a token."""
    return request.remote_addr or ""


# The websocket close code and reason for a socket whose token stopped being valid.
CLOSE_TOKEN_INVALID = 1008
CLOSE_TOKEN_INVALID_REASON = "the API token was revoked or has expired"


class TokenRecheck:
    """A long-lived connection's token, looked up again every ``every_s`` seconds.

    A revoked or expired token ends the connection within ``every_s`` plus the
    token cache's life (``token_cache_s``). A connection without a token has
    nothing to re-check.
    """

    def __init__(self, token: str | None, every_s: float) -> None:
        self.token = token
        self.every_s = every_s
        self._next = time.monotonic() + every_s

    def valid(self) -> bool:
        """False once the token no longer authenticates (checked at most every ``every_s``)."""
        if self.token is None or time.monotonic() < self._next:
            return True
        self._next = time.monotonic() + self.every_s
        try:
            return services().accounts.authenticate(self.token) is not None
        except SQLAlchemyError as exc:
            # The database is busy or down: the token was valid at the last
            # check; ask again next time rather than cut a working stream.
            log.info(
                "token re-check skipped (%s); retried in %.0f s", type(exc).__name__, self.every_s
            )
            return True
