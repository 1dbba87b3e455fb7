"""Bearer-token authentication.

A token comes in ``Authorization: Bearer <token>``; browsers' websockets, which
cannot set headers, may send it as the ``token`` query parameter instead.
"""

from __future__ import annotations

from flask import request

from api.errors import Unauthorized
from api.services import services
from db.accounts import Principal


def presented_token(*, allow_query: bool = False) -> str | None:
    header = request.headers.get("Authorization", "")
    if header:
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise Unauthorized("the Authorization header must be 'Bearer <token>'")
        return value.strip()
    if allow_query:
        return request.args.get("token") or None
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
