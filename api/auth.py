"""Bearer-token authentication and role checks.

A token comes in ``Authorization: Bearer <token>``. Browsers' websockets cannot
set headers, and a token in a URL ends up in logs and history, so a websocket
may instead offer it as a subprotocol: ``new WebSocket(url, ["switchyard",
"bearer.<token>"])`` (the server answers with ``switchyard``, never echoing the
token). The ``token`` query parameter is accepted on websockets and SSE too,
for clients that have no other way.

A bad token is always a 401, even on a public model: a client that sent a
credential expects it to be used.
"""

from __future__ import annotations

from flask import request

from api.errors import Forbidden, Unauthorized
from api.services import services
from db.accounts import Principal

SUBPROTOCOL = "switchyard"
SUBPROTOCOL_TOKEN_PREFIX = "bearer."


def _subprotocol_token() -> str | None:
    offered = request.headers.get("Sec-WebSocket-Protocol", "")
    for item in offered.split(","):
        item = item.strip()
        if item.lower().startswith(SUBPROTOCOL_TOKEN_PREFIX) and len(item) > 7:
            return item[len(SUBPROTOCOL_TOKEN_PREFIX) :]
    return None


def presented_token(*, allow_query: bool = False) -> str | None:
    """The token the request carries, or None; a malformed header is a 401.

    ``allow_query`` (websockets, SSE) also accepts the ``bearer.<token>``
    subprotocol and the ``token`` query parameter.
    """
    header = request.headers.get("Authorization", "")
    if header:
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise Unauthorized("the Authorization header must be 'Bearer <token>'")
        return value.strip()
    if allow_query:
        return _subprotocol_token() or request.args.get("token") or None
    return None


def optional_principal(*, allow_query: bool = False) -> Principal | None:
    """The caller, None when no token was sent; a bad token is always 401."""
    token = presented_token(allow_query=allow_query)
    if token is None:
        return None
    principal = services().accounts.authenticate(token)
    if principal is None:
        raise Unauthorized("the API token is invalid, expired or revoked")
    return principal


def require_principal(*, allow_query: bool = False) -> Principal:
    principal = optional_principal(allow_query=allow_query)
    if principal is None:
        raise Unauthorized()
    return principal


def require_role(*roles: str) -> Principal:
    """The caller, who must hold one of ``roles``: 401 without a token, 403 otherwise."""
    principal = require_principal()
    if principal.role not in roles:
        raise Forbidden(f"this needs the role {' or '.join(roles)}")
    return principal


def client_address() -> str:
    """The client's address, for the limits of callers without a token."""
    return request.remote_addr or ""
